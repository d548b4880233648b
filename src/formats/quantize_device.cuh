// Device building blocks of the bf16 -> E4M3 quantizers (formats/quantize_kernel.cu), for kernels that
// quantize rows they produce or move (the backward's gather and SwiGLU backward), with the same bits as
// the quantizers: the NOTES on bit-exactness in quantize_kernel.cu hold for everything here.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "formats/blockwise.h"
#include "formats/numerics.h"
#include "ptx/ptx.cuh"

namespace pounce::formats::quantize_device {

// 2^k for k in [-127, 127], from its bits; 2^-127 is the one float subnormal in that range.
__device__ __forceinline__ float exp2_int(int k) {
  return __uint_as_float(k >= -126 ? uint32_t(k + 127) << 23 : 0x00400000u);
}

// a = f * 2^floor_log2 with f in [1, 2), for the bits a of a finite nonzero |bf16|. above_1_75 says
// f > 1.75: 448 = 1.75 * 2^8, the threshold of the "ceil" rule.
struct Binade {
  int floor_log2;
  bool above_1_75;
};
__device__ __forceinline__ Binade binade_of(uint32_t a) {
  const uint32_t exponent = a >> 7, fraction = a & 0x7F;
  if (exponent != 0) return {int(exponent) - 127, fraction > 0x60};
  // Subnormal: a = fraction * 2^-133. Shift the leading one up to bit 7 (the implicit bit, dropped).
  const int lead = 31 - __clz(fraction);
  return {lead - 133, ((fraction << (7 - lead)) & 0x7F) > 0x60};
}

// The block's scale exponent from the bits of its finite amax (0: no finite nonzero element).
template <bool kMx>
__device__ __forceinline__ int scale_exponent(uint32_t amax) {
  if (amax == 0) return 0;
  const Binade b = binade_of(amax);
  // MX: floor(log2 amax) - 8. Blockwise: the smallest e with amax <= 1.75 * 2^(8 + e).
  const int e = b.floor_log2 - 8 + (kMx ? 0 : int(b.above_1_75));
  return min(max(e, kE8M0MinExponent), kE8M0MaxExponent);
}

// NOTES: the scaling multiply is ptx::mul_rn so that -ftz / --use_fast_math cannot flush subnormal bf16
// inputs: a block of subnormals has scale 2^-127 and its elements must survive the multiplication.
using ptx::mul_rn;

// Two E4M3 codes (lo in bits 0-7) as cvt.rn.satfinite gives them: a NaN may come out as 0x7F or 0xFF,
// so callers pass the codes through canonical_nan_codes.
__device__ __forceinline__ uint32_t e4m3x2_raw(float lo, float hi) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3);
}

// Four E4M3 codes with every NaN made the canonical 0x7F. With satfinite, a code whose low seven bits
// are all ones is a NaN (finite values and infinities saturate to 0x7E): adding 1 to those bits carries
// into bit 7 for exactly those codes, which marks the sign bits to clear.
__device__ __forceinline__ uint32_t canonical_nan_codes(uint32_t codes) {
  const uint32_t nan_bytes = ((codes & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return codes & ~nan_bytes;
}

// The largest finite magnitude among a chunk's 8 bf16 (as bits; see the NOTES above): the magnitudes'
// maximum two at a time, and element by element only for a chunk holding an Inf or a NaN.
__device__ __forceinline__ uint32_t finite_amax_bits(uint4 raw) {
  constexpr uint32_t kMagnitudes = 0x7FFF7FFFu;
  const uint32_t pairs = ptx::max_u16x2(ptx::max_u16x2(raw.x & kMagnitudes, raw.y & kMagnitudes),
                                        ptx::max_u16x2(raw.z & kMagnitudes, raw.w & kMagnitudes));
  const uint32_t amax = max(pairs & 0xFFFFu, pairs >> 16);
  if (amax < 0x7F80) return amax;
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};  // element 2i in the low half of words[i]
  uint32_t finite = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t a = (words[i / 2] >> (16 * (i % 2))) & 0x7FFF;
    if (a < 0x7F80) finite = max(finite, a);
  }
  return finite;
}

// A chunk's 8 bf16 times inv_scale, as 8 E4M3 codes in element order.
__device__ __forceinline__ uint2 e4m3x8(uint4 raw, float inv_scale) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  uint32_t codes[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float x0 = __uint_as_float(words[2 * i] << 16), x1 = __uint_as_float(words[2 * i] & 0xFFFF0000u);
    const float x2 = __uint_as_float(words[2 * i + 1] << 16), x3 = __uint_as_float(words[2 * i + 1] & 0xFFFF0000u);
    codes[i] = canonical_nan_codes(e4m3x2_raw(mul_rn(x0, inv_scale), mul_rn(x1, inv_scale)) |
                                   e4m3x2_raw(mul_rn(x2, inv_scale), mul_rn(x3, inv_scale)) << 16);
  }
  return make_uint2(codes[0], codes[1]);
}

// The scale exponent (MX or blockwise rule) of a block whose elements are spread over kLanes consecutive
// lanes (aligned groups), each lane holding its own part's finite amax (bits): the lanes' maximum by
// shuffles, then scale_exponent. Every lane of the warp must call it.
template <bool kMx, int kLanes>
__device__ __forceinline__ int block_scale_exponent(uint32_t amax) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
  return scale_exponent<kMx>(amax);
}

template <bool kMx>
using ScaleT = std::conditional_t<kMx, uint8_t, float>;  // E8M0 codes, or fp32 powers of two

// Where block `block` (the flat index of a row-major [rows, blocks_per_row] matrix of blocks) keeps its
// scale: that index (row-major), or K block-major [blocks_per_row, block_major_rows] (formats::ScaleLayout).
struct ScaleSlots {
  int64_t blocks_per_row = 1;
  int64_t block_major_rows = 0;  // 0: row-major
  __device__ __forceinline__ int64_t operator()(int64_t block) const {
    if (block_major_rows == 0) return block;
    return block % blocks_per_row * block_major_rows + block / blocks_per_row;
  }
};

// A 16-byte chunk's codes and its block's scale exponent: quantize_chunk without the stores, for callers
// that run several chunks' shuffles between their loads and their stores. Every lane of the warp calls it.
struct QuantizedChunk {
  uint2 codes;
  int exponent;
};
template <bool kMx>
__device__ __forceinline__ QuantizedChunk quantize_chunk_codes(uint4 raw) {
  constexpr int kLanes = (kMx ? kMxBlock : kActivationBlock) / 8;  // 4 or 16
  const int e = block_scale_exponent<kMx, kLanes>(finite_amax_bits(raw));
  return {e4m3x8(raw, exp2_int(-e)), e};  // e >= -127 keeps the inverse scale <= 2^127
}

// One 16-byte chunk (8 bf16, index `chunk` of a row-major matrix of whole blocks) quantized within its
// block (1 x 128, or 1 x 32 for MX), whose chunks are consecutive lanes (an aligned group): codes to chunk
// `chunk` of out, the block's scale to its slot of scales (`slots`). Every lane of the warp calls it (the
// block's amax is a shuffle); inactive lanes only skip the stores.
template <bool kMx>
__device__ __forceinline__ void quantize_chunk(uint4 raw, int64_t chunk, bool active, uint8_t* out, ScaleT<kMx>* scales,
                                               ScaleSlots slots = {}) {
  constexpr int kLanes = (kMx ? kMxBlock : kActivationBlock) / 8;  // 4 or 16
  const auto [codes, e] = quantize_chunk_codes<kMx>(raw);
  if (!active) return;
  reinterpret_cast<uint2*>(out)[chunk] = codes;
  if (chunk % kLanes == 0) {
    if constexpr (kMx)
      scales[slots(chunk / kLanes)] = uint8_t(e + kE8M0Bias);
    else
      scales[slots(chunk / kLanes)] = exp2_int(e);
  }
}

}  // namespace pounce::formats::quantize_device
