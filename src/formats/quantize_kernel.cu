// Device quantizers bf16 -> E4M3 with 1x128 fp32 or 1x32 E8M0 power-of-two scales.
//
// NOTES: layout. A chunk is 8 consecutive bf16: one 16-byte load, one 8-byte store. A CTA covers
// kChunksPerThread slabs of 256 chunks; in each slab thread t takes chunk t, so a warp reads 512
// contiguous bytes and writes 256 (fully coalesced), and all of a thread's loads are issued before any
// math to keep several in flight. cols is a multiple of the block, so a block never straddles two rows
// and the flat index of a block is also the index of its scale in the row-major [rows, cols / block]
// scale array (K block-major scales cost one division per block, in the lane that stores the scale).
// A 128-block is 16 consecutive lanes (half a warp), a 32-block 4 lanes; shuffles with xor offsets below
// that count stay inside the block. Every lane takes part in the shuffles (no early exit before them);
// chunks past the end only skip their loads and stores, and since n is a multiple of the block, a block
// is either wholly in or wholly out.
//
// NOTES: bit-exactness with the host reference (formats/blockwise.cpp), written independently:
// - amax on the bf16 bits: for non-negative values the integer order is the value order, and NaN/Inf
//   are exactly the magnitudes >= 0x7F80, so skipping those is "amax over finite elements".
// - the scale exponent from the amax's exponent and fraction bits (subnormal bf16 normalized by hand).
// - x * 2^-e is exact (or a float subnormal, which E4M3 turns into +-0 either way), so the only rounding
//   is cvt.rn.satfinite, whose NaN output is made canonical (0x7F) here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/gpu.h"
#include "common/require.h"
#include "formats/blockwise.h"
#include "formats/numerics.h"
#include "formats/quantize_device.cuh"
#include "formats/quantize_kernel.h"
#include "ptx/ptx.cuh"

namespace pounce::formats {
namespace {

using namespace quantize_device;

// Refuses [rows, cols] (non-negative) with more elements than int64 counts: a caller's garbage sizes
// would otherwise wrap into a small or negative launch.
void require_countable(const char* name, int64_t rows, int64_t cols) {
  POUNCE_REQUIRE(cols == 0 || rows <= INT64_MAX / cols, name, ": shape [", rows, ", ", cols,
                 "] has more than 2^63 - 1 elements");
}

constexpr int kElemsPerThread = 8;  // one 16-byte load of bf16
constexpr int kThreadsPerCta = 256;
constexpr int kChunksPerThread = 4;  // loads in flight per thread: 4 gave ~15% more bandwidth than 1 on H200

// With source_row, output row r is x's row source_row[r] (a gather; negative: a row of zeros); a chunk
// never straddles two rows (cols is a multiple of 8).
template <bool kMx>
__global__ void __launch_bounds__(kThreadsPerCta)
    quantize_kernel(const uint16_t* __restrict__ x, const int32_t* __restrict__ source_row, int64_t cols, int64_t n,
                    uint8_t* __restrict__ out, ScaleT<kMx>* __restrict__ scales, ScaleSlots slots) {
  // All loads first, so each thread has kChunksPerThread 16-byte loads in flight.
  int64_t first[kChunksPerThread];
  uint4 raw[kChunksPerThread];
#pragma unroll
  for (int c = 0; c < kChunksPerThread; ++c) {
    first[c] = ((int64_t(blockIdx.x) * kChunksPerThread + c) * kThreadsPerCta + threadIdx.x) * kElemsPerThread;
    int64_t from = first[c];
    if (source_row != nullptr && first[c] < n) {
      const int32_t row = source_row[first[c] / cols];
      from = row >= 0 ? int64_t(row) * cols + first[c] % cols : -1;
    }
    raw[c] = first[c] < n && from >= 0 ? *reinterpret_cast<const uint4*>(x + from) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int c = 0; c < kChunksPerThread; ++c)  // an inactive chunk lies past the end
    quantize_chunk<kMx>(raw[c], first[c] / kElemsPerThread, first[c] < n, out, scales, slots);
}

// A 1 x 128 scale layout for [rows, cols]: refused unless row-major or block-major over at least `rows`.
ScaleSlots slots_of(const char* name, ScaleLayout layout, int64_t rows, int64_t cols) {
  POUNCE_REQUIRE(layout.block_major_rows == 0 || layout.block_major_rows >= rows, name,
                 ": ScaleLayout::block_major_rows = ", layout.block_major_rows,
                 " must be 0 (row-major scales) or at least rows = ", rows);
  return {cols / kActivationBlock, layout.block_major_rows};
}

template <bool kMx>
void launch(const char* name, const uint16_t* x, const int32_t* source_row, int64_t rows, int64_t cols, uint8_t* out,
            ScaleT<kMx>* scales, cudaStream_t stream, ScaleLayout layout = {}) {
  constexpr int kBlock = kMx ? kMxBlock : kActivationBlock;
  POUNCE_REQUIRE(rows >= 0 && cols >= 0, name, ": shape [", rows, ", ", cols, "] has a negative extent");
  POUNCE_REQUIRE(cols % kBlock == 0, name, ": cols = ", cols, " is not a multiple of ", kBlock);
  const ScaleSlots slots = kMx ? ScaleSlots{} : slots_of(name, layout, rows, cols);
  require_countable(name, rows, cols);
  const int64_t n = rows * cols;
  if (n == 0) return;
  POUNCE_REQUIRE(x != nullptr, name, ": x is null");
  POUNCE_REQUIRE(out != nullptr, name, ": out is null");
  POUNCE_REQUIRE(scales != nullptr, name, ": scales is null");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0, name, ": x = ", static_cast<const void*>(x),
                 " is not 16-byte aligned");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(out) % 8 == 0, name, ": out = ", static_cast<const void*>(out),
                 " is not 8-byte aligned");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(scales) % alignof(ScaleT<kMx>) == 0, name,
                 ": scales = ", static_cast<const void*>(scales), " is not ", alignof(ScaleT<kMx>), "-byte aligned");
  const int64_t per_cta = int64_t(kThreadsPerCta) * kElemsPerThread * kChunksPerThread;
  const int64_t ctas = (n + per_cta - 1) / per_cta;
  POUNCE_REQUIRE(ctas <= INT_MAX, name, ": ", rows, " x ", cols, " elements need more than 2^31 - 1 CTAs");
  quantize_kernel<kMx><<<unsigned(ctas), kThreadsPerCta, 0, stream>>>(x, source_row, cols, n, out, scales, slots);
  CUDA_CHECK_LAUNCH();
}

// One CTA per 128 x 128 block (weights): thread t takes 8 of the block's rows (t / 16 + 16 i), 8 columns
// each, so a row is 16 lanes and every load is 16 contiguous bytes. amax over the block by warp
// shuffles and one shared-memory round.
__global__ void __launch_bounds__(kThreadsPerCta)
    quantize_128x128_kernel(const uint16_t* __restrict__ x, int64_t cols, uint8_t* __restrict__ out,
                            float* __restrict__ scales) {
  constexpr int kRowsPerThread = kWeightBlock * kWeightBlock / kElemsPerThread / kThreadsPerCta;  // 8
  constexpr int kRowStep = kThreadsPerCta / (kWeightBlock / kElemsPerThread);                     // 16
  const int64_t col = int64_t(blockIdx.x) * kWeightBlock + (threadIdx.x % 16) * kElemsPerThread;
  const int64_t row0 = int64_t(blockIdx.y) * kWeightBlock + threadIdx.x / 16;
  uint4 raw[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
    raw[i] = *reinterpret_cast<const uint4*>(x + (row0 + i * kRowStep) * cols + col);

  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) amax = max(amax, finite_amax_bits(raw[i]));
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  __shared__ uint32_t warp_amax[kThreadsPerCta / 32];
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreadsPerCta / 32; ++w) amax = max(amax, warp_amax[w]);

  const int e = scale_exponent<false>(amax);
  const float inv_scale = exp2_int(-e);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
    *reinterpret_cast<uint2*>(out + (row0 + i * kRowStep) * cols + col) = e4m3x8(raw[i], inv_scale);
  if (threadIdx.x == 0) scales[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = exp2_int(e);
}

// E8M0 code -> its power of two (0xFF: NaN; 0: 2^-127, a float subnormal).
__device__ __forceinline__ float e8m0_value(uint8_t code) {
  if (code == kE8M0NaN) return __int_as_float(0x7FC00000);
  return code == 0 ? __int_as_float(0x00400000) : __int_as_float(uint32_t(code) << 23);
}

// One thread per 8 elements: E4M3 -> float (exact) times the block's power-of-two scale (exact unless
// subnormal) -> bf16 (exact for 4 significant bits; the host reference rounds the same two steps). kMx:
// E8M0 scales, one per 32 elements of a row; else fp32 ones per 1 x 128 (block_rows 1, at `slots`) or
// 128 x 128 block.
template <bool kMx>
__global__ void dequantize_kernel(const uint8_t* __restrict__ q, const void* __restrict__ scales, int64_t rows,
                                  int64_t cols, int block_rows, ScaleSlots slots, uint16_t* __restrict__ out) {
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * kElemsPerThread;
  if (first >= rows * cols) return;
  const int64_t row = first / cols, col = first % cols;
  const float scale = kMx ? e8m0_value(static_cast<const uint8_t*>(scales)[row * (cols / kMxBlock) + col / kMxBlock])
                          : static_cast<const float*>(
                                scales)[slots((row / block_rows) * (cols / kActivationBlock) + col / kActivationBlock)];
  const uint2 codes = *reinterpret_cast<const uint2*>(q + first);
  const uint32_t words[2] = {codes.x, codes.y};
  uint32_t bf16x2[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t pair = (words[i / 2] >> (16 * (i % 2))) & 0xFFFF;
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3);
    const float lo = mul_rn(__half2float(__ushort_as_half(h.x)), scale);
    const float hi = mul_rn(__half2float(__ushort_as_half(h.y)), scale);
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    bf16x2[i] = *reinterpret_cast<const uint32_t*>(&v);
  }
  *reinterpret_cast<uint4*>(out + first) = make_uint4(bf16x2[0], bf16x2[1], bf16x2[2], bf16x2[3]);
}

// One CTA per 128 x 128 block, staged in shared memory: rows loaded as 16-byte vectors, then each thread
// gathers 16 rows of one column into a 16-byte vector of the transposed row. Consecutive threads take
// consecutive columns, so a warp's shared-memory reads fall in one row (no bank conflicts).
__global__ void __launch_bounds__(kThreadsPerCta)
    transpose_128x128_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t rows,
                             int64_t cols, uint8_t* __restrict__ out, float* __restrict__ out_scales) {
  constexpr int kB = kWeightBlock, kVectors = kB / 16, kPitch = kB + 16;  // row pitch: 16-byte aligned
  __shared__ alignas(16) uint8_t tile[kB * kPitch];
  const int64_t block_rows = rows / kB, block_cols = cols / kB;
  const int64_t block = blockIdx.x, bc = block % block_cols, br = (block / block_cols) % block_rows;
  const int64_t m = block / (block_cols * block_rows);
  const uint8_t* from = q + (m * rows + br * kB) * cols + bc * kB;
  for (int i = threadIdx.x; i < kB * kVectors; i += kThreadsPerCta) {
    const int r = i / kVectors, v = i % kVectors;
    *reinterpret_cast<uint4*>(&tile[r * kPitch + 16 * v]) = *reinterpret_cast<const uint4*>(from + r * cols + 16 * v);
  }
  __syncthreads();
  uint8_t* to = out + (m * cols + bc * kB) * rows + br * kB;
  for (int i = threadIdx.x; i < kB * kVectors; i += kThreadsPerCta) {
    const int c = i % kB, v = i / kB;  // transposed row c, its 16-byte vector v: source rows 16 v ..
    alignas(16) uint8_t bytes[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) bytes[j] = tile[(16 * v + j) * kPitch + c];
    *reinterpret_cast<uint4*>(to + int64_t(c) * rows + 16 * v) = *reinterpret_cast<const uint4*>(bytes);
  }
  if (threadIdx.x == 0)
    out_scales[(m * block_cols + bc) * block_rows + br] = scales[(m * block_rows + br) * block_cols + bc];
}

// A persistent CTA loops over 128 x 128 tiles of x (only those of the rows in use), each staged in shared
// memory with rows paired: word (p, c) holds column c of rows 2 p and 2 p + 1 (the lower row in the low
// half), so a thread reading its column down the rows gets two elements per 4-byte load, already in the
// chunk order of the row-wise quantizer (element 2i in the low half of word i). Thread c then owns column
// c of the tile, one row of the output: it reads the column twice (a warp reads 32 neighbouring words of
// one pair of rows at a time: no bank conflicts), once for the block's amax and once to convert, eight
// rows at a time, so that only a chunk is live (the one-pass form held all 128 values: 167 registers).
// The converted rows go back through shared memory, so that eight lanes store each 128-byte output row
// whole: stored straight from thread c, every store instruction of a warp wrote 16 bytes into each of
// 32 different rows.
constexpr int kTransposeThreads = 128;
__global__ void __launch_bounds__(kTransposeThreads)
    quantize_1x128_transposed_kernel(const uint16_t* __restrict__ x, int64_t rows, int64_t cols,
                                     uint8_t* __restrict__ out, float* __restrict__ scales,
                                     const int32_t* __restrict__ rows_in_use) {
  constexpr int kB = kActivationBlock, kVectors = kB / kElemsPerThread;
  constexpr int kPieces = kB / 16;       // 16-byte pieces of an output row
  constexpr int kStagedPitch = kB + 16;  // bytes; 16-byte aligned, and a store phase's eight rows
                                         // start on eight different 4-bank groups
  __shared__ alignas(16) uint32_t pairs[kB / 2][kB];
  // The converted tile, [column][row] bytes, reuses `pairs` once every thread has read its column.
  uint8_t* const staged = reinterpret_cast<uint8_t*>(&pairs[0][0]);
  static_assert(kB * kStagedPitch <= int(sizeof(pairs)));
  const int64_t block_cols = cols / kB;
  const int64_t used_rows = rows_in_use != nullptr ? min(rows, int64_t(*rows_in_use)) : rows;
  const int64_t tiles = (used_rows + kB - 1) / kB * block_cols;
  const int c = threadIdx.x;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t rb = tile / block_cols, cb = tile % block_cols;
    const uint16_t* from = x + rb * kB * cols + cb * kB;
    // A thread takes 8 column chunks of both rows of a pair: all 16 of its loads first, then its
    // shared-memory stores (16 loads in flight per thread instead of one).
    constexpr int kPairChunks = kB / 2 * kVectors / kTransposeThreads;  // 8
    uint4 upper[kPairChunks], lower[kPairChunks];
#pragma unroll
    for (int j = 0; j < kPairChunks; ++j) {
      const int i = threadIdx.x + j * kTransposeThreads, p = i / kVectors, v = i % kVectors;
      upper[j] = *reinterpret_cast<const uint4*>(from + (2 * p) * cols + v * kElemsPerThread);
      lower[j] = *reinterpret_cast<const uint4*>(from + (2 * p + 1) * cols + v * kElemsPerThread);
    }
#pragma unroll
    for (int j = 0; j < kPairChunks; ++j) {
      const int i = threadIdx.x + j * kTransposeThreads, p = i / kVectors, v = i % kVectors;
      const uint32_t a[4] = {upper[j].x, upper[j].y, upper[j].z, upper[j].w};
      const uint32_t b[4] = {lower[j].x, lower[j].y, lower[j].z, lower[j].w};
      uint32_t words[8];  // columns 8 v .. 8 v + 7
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        words[2 * k] = __byte_perm(a[k], b[k], 0x5410);      // the even column's two rows
        words[2 * k + 1] = __byte_perm(a[k], b[k], 0x7632);  // the odd column's
      }
      // A thread's two 16-byte stores in the order (v / 4) % 2: the eight lanes of a store phase then
      // cover all 32 banks once.
      uint4* const to = reinterpret_cast<uint4*>(&pairs[p][v * kElemsPerThread]);
      const int first = v / 4 % 2;
      to[first] = first == 0 ? make_uint4(words[0], words[1], words[2], words[3])
                             : make_uint4(words[4], words[5], words[6], words[7]);
      to[1 - first] = first == 0 ? make_uint4(words[4], words[5], words[6], words[7])
                                 : make_uint4(words[0], words[1], words[2], words[3]);
    }
    __syncthreads();
    // Column rows 8 v .. 8 v + 7 as a chunk of 8 bf16.
    const auto chunk = [&](int v) {
      return make_uint4(pairs[4 * v][c], pairs[4 * v + 1][c], pairs[4 * v + 2][c], pairs[4 * v + 3][c]);
    };
    uint32_t amax = 0;
#pragma unroll 4
    for (int v = 0; v < kVectors; ++v) amax = max(amax, finite_amax_bits(chunk(v)));
    const int e = scale_exponent<false>(amax);
    const float inv_scale = exp2_int(-e);
    uint4 converted[kPieces];
#pragma unroll
    for (int v = 0; v < kVectors; v += 2) {
      const uint2 lo = e4m3x8(chunk(v), inv_scale), hi = e4m3x8(chunk(v + 1), inv_scale);
      converted[v / 2] = make_uint4(lo.x, lo.y, hi.x, hi.y);
    }
    scales[rb * cols + cb * kB + c] = exp2_int(e);
    __syncthreads();  // every column read before `staged` overwrites the pairs
#pragma unroll
    for (int j = 0; j < kPieces; ++j) *reinterpret_cast<uint4*>(staged + c * kStagedPitch + 16 * j) = converted[j];
    __syncthreads();
    // Output row cb * kB + r holds rows rb * kB .. + kB of x's column r: eight lanes a row, 16 bytes each.
#pragma unroll
    for (int j = 0; j < kPieces; ++j) {
      const int i = threadIdx.x + j * kTransposeThreads, r = i / kPieces, piece = i % kPieces;
      *reinterpret_cast<uint4*>(out + (cb * kB + r) * rows + rb * kB + 16 * piece) =
          *reinterpret_cast<const uint4*>(staged + r * kStagedPitch + 16 * piece);
    }
    __syncthreads();  // the staged rows stored before the next tile's pairs overwrite them
  }
}

// What both dequantizers check and do once their shape is known to be whole blocks.
template <bool kMx>
void launch_dequantize(const char* name, const uint8_t* q, const void* scales, int64_t rows, int64_t cols,
                       int block_rows, uint16_t* out_bf16, cudaStream_t stream, ScaleSlots slots = {}) {
  require_countable(name, rows, cols);
  if (rows == 0 || cols == 0) return;
  POUNCE_REQUIRE(q != nullptr && scales != nullptr && out_bf16 != nullptr, name, ": q, scales and out must be set");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(q) % 8 == 0 && reinterpret_cast<uintptr_t>(out_bf16) % 16 == 0, name,
                 ": q must be 8-byte and out 16-byte aligned");
  const int64_t threads = rows * cols / kElemsPerThread;
  const int64_t ctas = (threads + kThreadsPerCta - 1) / kThreadsPerCta;
  POUNCE_REQUIRE(ctas <= INT_MAX, name, ": ", rows, " x ", cols, " elements need more than 2^31 - 1 CTAs");
  dequantize_kernel<kMx>
      <<<unsigned(ctas), kThreadsPerCta, 0, stream>>>(q, scales, rows, cols, block_rows, slots, out_bf16);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void dequantize_blockwise_device(const uint8_t* q, const float* scales, int64_t rows, int64_t cols, int block_rows,
                                 uint16_t* out_bf16, cudaStream_t stream, ScaleLayout layout) {
  constexpr const char* name = "dequantize_blockwise_device";
  POUNCE_REQUIRE(block_rows == 1 || block_rows == kWeightBlock, name, ": block_rows = ", block_rows,
                 " (1 for 1 x 128 blocks, 128 for 128 x 128)");
  POUNCE_REQUIRE(rows >= 0 && cols >= 0 && cols % kActivationBlock == 0 && rows % block_rows == 0, name, ": shape [",
                 rows, ", ", cols, "] is not made of whole ", block_rows, " x 128 blocks");
  POUNCE_REQUIRE(block_rows == 1 || layout.block_major_rows == 0, name,
                 ": K block-major scales are for 1 x 128 blocks (block_rows 1)");
  launch_dequantize<false>(name, q, scales, rows, cols, block_rows, out_bf16, stream,
                           slots_of(name, layout, rows, cols));
}

void dequantize_mxfp8_device(const uint8_t* q, const uint8_t* scales, int64_t rows, int64_t cols, uint16_t* out_bf16,
                             cudaStream_t stream) {
  constexpr const char* name = "dequantize_mxfp8_device";
  POUNCE_REQUIRE(rows >= 0 && cols >= 0 && cols % kMxBlock == 0, name, ": shape [", rows, ", ", cols,
                 "] is not made of whole 1 x ", kMxBlock, " blocks");
  launch_dequantize<true>(name, q, scales, rows, cols, 1, out_bf16, stream);
}

void quantize_128x128_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, float* scales,
                             cudaStream_t stream) {
  constexpr const char* name = "quantize_128x128_device";
  POUNCE_REQUIRE(rows >= 0 && cols >= 0, name, ": shape [", rows, ", ", cols, "] has a negative extent");
  POUNCE_REQUIRE(rows % kWeightBlock == 0 && cols % kWeightBlock == 0, name, ": shape [", rows, ", ", cols,
                 "] is not made of whole ", kWeightBlock, " x ", kWeightBlock, " blocks");
  require_countable(name, rows, cols);
  if (rows == 0 || cols == 0) return;
  POUNCE_REQUIRE(x_bf16 != nullptr && out != nullptr && scales != nullptr, name, ": x, out and scales must be set");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(x_bf16) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(scales) % 4 == 0,
                 name, ": x must be 16-byte, out 8-byte and scales 4-byte aligned");
  POUNCE_REQUIRE(rows / kWeightBlock <= 65535 && cols / kWeightBlock <= INT_MAX, name, ": [", rows, ", ", cols,
                 "] has too many blocks for one launch");
  const dim3 grid(unsigned(cols / kWeightBlock), unsigned(rows / kWeightBlock));
  quantize_128x128_kernel<<<grid, kThreadsPerCta, 0, stream>>>(x_bf16, cols, out, scales);
  CUDA_CHECK_LAUNCH();
}

void transpose_128x128_device(const uint8_t* q, const float* scales, int64_t matrices, int64_t rows, int64_t cols,
                              uint8_t* out, float* out_scales, cudaStream_t stream) {
  constexpr const char* name = "transpose_128x128_device";
  POUNCE_REQUIRE(matrices >= 0 && rows >= 0 && cols >= 0, name, ": ", matrices, " matrices of [", rows, ", ", cols,
                 "] has a negative extent");
  POUNCE_REQUIRE(rows % kWeightBlock == 0 && cols % kWeightBlock == 0, name, ": shape [", rows, ", ", cols,
                 "] is not made of whole ", kWeightBlock, " x ", kWeightBlock, " blocks");
  if (matrices == 0 || rows == 0 || cols == 0) return;
  require_countable(name, matrices, rows);
  require_countable(name, matrices * rows, cols);
  POUNCE_REQUIRE(q != nullptr && scales != nullptr && out != nullptr && out_scales != nullptr, name,
                 ": q, scales, out and out_scales must be set");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(q) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0, name,
                 ": q and out must be 16-byte aligned");
  const int64_t blocks = matrices * (rows / kWeightBlock) * (cols / kWeightBlock);
  POUNCE_REQUIRE(blocks <= INT_MAX, name, ": ", blocks, " blocks are too many for one launch");
  transpose_128x128_kernel<<<unsigned(blocks), kThreadsPerCta, 0, stream>>>(q, scales, rows, cols, out, out_scales);
  CUDA_CHECK_LAUNCH();
}

void quantize_1x128_transposed_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, float* scales,
                                      cudaStream_t stream, const int32_t* rows_in_use) {
  constexpr const char* name = "quantize_1x128_transposed_device";
  POUNCE_REQUIRE(rows >= 0 && cols >= 0, name, ": shape [", rows, ", ", cols, "] has a negative extent");
  POUNCE_REQUIRE(rows % kActivationBlock == 0 && cols % kActivationBlock == 0, name, ": shape [", rows, ", ", cols,
                 "] is not made of whole 128 x 128 tiles");
  require_countable(name, rows, cols);
  if (rows == 0 || cols == 0) return;
  POUNCE_REQUIRE(x_bf16 != nullptr && out != nullptr && scales != nullptr, name, ": x, out and scales must be set");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(x_bf16) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(scales) % 4 == 0,
                 name, ": x and out must be 16-byte and scales 4-byte aligned");
  const int64_t tiles = (rows / kActivationBlock) * (cols / kActivationBlock);
  POUNCE_REQUIRE(tiles <= INT_MAX, name, ": [", rows, ", ", cols, "] has too many tiles for one launch");
  // As many CTAs as fit on the GPU at once, at most one per tile: with rows_in_use the tiles in use are
  // known only on the device, and the capacity past them can be several times as many. (Its residency
  // is the kernel's alone: asked once.)
  static const int per_sm = [] {
    int n = 0;
    CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, quantize_1x128_transposed_kernel, kTransposeThreads, 0));
    return std::max(n, 1);
  }();
  const int64_t ctas = std::min<int64_t>(tiles, int64_t(per_sm) * gpu_info().multiprocessors);
  quantize_1x128_transposed_kernel<<<unsigned(ctas), kTransposeThreads, 0, stream>>>(x_bf16, rows, cols, out, scales,
                                                                                     rows_in_use);
  CUDA_CHECK_LAUNCH();
}

void quantize_1x128_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, float* scales,
                           cudaStream_t stream, ScaleLayout layout) {
  launch<false>("quantize_1x128_device", x_bf16, nullptr, rows, cols, out, scales, stream, layout);
}

void quantize_1x128_gather_device(const uint16_t* x_bf16, const int32_t* source_row, int64_t rows, int64_t cols,
                                  uint8_t* out, float* scales, cudaStream_t stream, ScaleLayout layout) {
  POUNCE_REQUIRE(rows == 0 || source_row != nullptr, "quantize_1x128_gather_device: source_row is null");
  launch<false>("quantize_1x128_gather_device", x_bf16, source_row, rows, cols, out, scales, stream, layout);
}

void quantize_mxfp8_device(const uint16_t* x_bf16, int64_t rows, int64_t cols, uint8_t* out, uint8_t* scales,
                           cudaStream_t stream) {
  launch<true>("quantize_mxfp8_device", x_bf16, nullptr, rows, cols, out, scales, stream);
}

}  // namespace pounce::formats
