// Grouped GEMMs for the expert FFN on Hopper (sm_90a), forward and backward. Two groupings:
//   m-grouped (forward, and the backward's data gradients): for every local expert e,
//     C[rows of e] = epilogue( A[rows of e] . B[e]^T )
//   A is the expert-contiguous token pool [rows, K] bf16 (each expert's rows start on a 128-row
//   m-block); B the expert weights, [E, N, K] (K-major) or [E, K, N] (N-major: the forward's weights
//   used transposed); C [rows, N] (plain) or [rows, N/2] (SwiGLU).
//   k-grouped (the backward's weight gradients): for every local expert e,
//     C[e] (+)= A[rows of e]^T . B[rows of e]        C [E, M, N] fp32 or bf16
//   A [rows, M] and B [rows, N] are expert-contiguous row buffers: the reduction runs over each expert's
//   rows, as many as the device schedule says (nothing about them on the host).
//
// FP8: the m-grouped GEMM also takes E4M3 operands with power-of-two block scales (GroupedGemmArgs::fp8):
// A with one scale per 1 x 128 block of a row, B with one per 128 x 128 block (formats/blockwise.h). The
// engine applies them in fp32 every 128 of K and writes the same bf16 epilogues.
//
// Persistent CTAs take tiles (expert, m-block, n-block) of 128 x 256 (bf16) or 128 x 128 (FP8) from a
// device queue. Before loading A for a tile, a CTA waits (acquire, bounded) until that m-block's
// readiness counter reaches `ready_target`: the megakernel's dispatch bumps these counters; stand-alone
// callers pass none.
//
// Padding rows (beyond an expert's routes, up to its m-block boundary) are computed like any row but
// never mix into other rows: each output row depends on its own A row only. Their outputs are
// whatever the padding A rows produce (zeros when dispatch zero-fills them); callers ignore them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_buffer.h"
#include "common/device_error.h"
#include "common/tiles.h"
#include "common/timeline.h"

namespace pounce::gemm {

// Consumer warpgroups of the engine's CTA (gemm/gemm_pipeline.cuh), each computing half of a tile's rows
// and adding 1 to the tile's completion counter: a finished tile counts kConsumerWarpgroups.
inline constexpr int kConsumerWarpgroups = 2;

// TMA boxes of the C stores: 64 bf16 (128 bytes, one swizzle row) wide and one consumer's rows high.
inline constexpr int kStoreBoxCols = 64;
inline constexpr int kStoreBoxRows = kBlockM / kConsumerWarpgroups;

enum class Epilogue {
  kStore,     // C = A . B^T, bf16                                              [rows, N]
  kSwiGLU,    // C = silu(gate) * up, gate/up interleaved in groups of 8 along N, bf16   [rows, N/2]
  kStoreF32,  // C = A . B^T, fp32 (k-grouped)
  kAddF32,    // C += A . B^T, fp32 (k-grouped: a gradient accumulated across steps)
};

// Which dimension of an operand is contiguous in memory: K, or its M / N.
enum class Major { kK, kMN };

// Scheduling knobs. The default is the measured best on the H200 (docs/grouped_gemm.md); the
// benchmark sweeps the alternatives so that stays checked.
struct GemmTuning {
  // M-blocks of one expert walked together, m-fastest, before moving to the next band (L2 locality).
  int band_m_blocks = 16;
};

// E4M3 operands of an FP8 GEMM, K-major (as a and b with b_major kK), each with its fp32 power-of-two
// block scales; the bf16 a and b stay null. A's scales are K block-major (one 128-wide K block's scales
// of all rows lie together, so a tile's 128 row scales of a slice are 512 contiguous bytes): what
// formats::quantize_1x128_device writes with ScaleLayout{a_rows}.
struct Fp8Operands {
  const uint8_t* a = nullptr;      // [a_rows, k]
  const float* a_scale = nullptr;  // [k / 128, a_rows]: 1 x 128 blocks, K block-major; 16-byte aligned
  const uint8_t* b = nullptr;      // [experts, n, k]
  const float* b_scale = nullptr;  // [experts * n / 128, k / 128]: 128 x 128 blocks
};

struct GroupedGemmArgs {
  const __nv_bfloat16* a = nullptr;  // [a_rows, k]
  int64_t a_rows = 0;                // rows of the A buffer (capacity), a multiple of 128
  const __nv_bfloat16* b = nullptr;  // [experts, n, k] (b_major kK) or [experts, k, n] (kMN)
  Major b_major = Major::kK;
  Fp8Operands fp8;  // set (with a and b null) for an FP8 GEMM: n and k then multiples of 128
  int experts = 0;
  int64_t n = 0, k = 0;        // multiples of 64
  __nv_bfloat16* c = nullptr;  // [a_rows, n] or [a_rows, n / 2]
  Epilogue epilogue = Epilogue::kStore;
  // Device [experts + 1]: first row of each expert, multiples of 128; [experts] = rows in use.
  const int32_t* expert_offsets = nullptr;
  // Optional device [a_rows]: every output row is multiplied by its scale (the router weight).
  const float* row_scale = nullptr;
  // Optional device [experts]: the rows of each expert that hold routes (the rest of its m-blocks is
  // padding). A consumer warpgroup whose 64 rows of a tile are all padding skips its MMAs and leaves those
  // rows of C unwritten; without it padding rows are computed like any other.
  const int32_t* expert_rows = nullptr;
  // Optional device [a_rows / 128] readiness counters; tiles of m-block b wait for counter >= ready_target.
  const uint32_t* m_block_ready = nullptr;
  uint32_t ready_target = 0;
  GemmTuning tuning;
  uint64_t wait_timeout_ns = 5'000'000'000ull;  // per wait
  int max_ctas = 0;                             // 0: one per multiprocessor
  TimelineSink timeline;  // where the launch records its spans (a build with POUNCE_TIMELINE); {}: nowhere
};

// E4M3 operands of an FP8 k-grouped GEMM: the row buffers quantized along their rows (the GEMM's K) and
// stored transposed (formats::quantize_1x128_transposed_device), with fp32 power-of-two scales, one per
// row of the transposed buffer and 128 of K, stored K block-major (a K block's scales lie together).
struct KGroupedFp8Operands {
  const uint8_t* a = nullptr;      // [m, rows]: A's row buffer transposed
  const float* a_scale = nullptr;  // [rows / 128, m], 16-byte aligned
  const uint8_t* b = nullptr;      // [n, rows]
  const float* b_scale = nullptr;  // [rows / 128, n], 16-byte aligned
};

// C[e] (+)= A[rows of e]^T . B[rows of e] for every expert e: weight gradients.
struct KGroupedGemmArgs {
  const __nv_bfloat16* a = nullptr;  // [rows, m]
  const __nv_bfloat16* b = nullptr;  // [rows, n]
  int64_t rows = 0;                  // rows of both buffers (capacity), a multiple of 128
  int64_t m = 0, n = 0;              // multiples of 64
  KGroupedFp8Operands fp8;           // set (with a and b null) for an FP8 GEMM: m and n then multiples of 128
  int experts = 0;
  // Device [experts + 1]: first row of each expert, multiples of 128; rows past [experts] are not read.
  // Every row in use must be finite; padding rows must be zero in A or B (they are summed like any row).
  const int32_t* expert_offsets = nullptr;
  // Optional device [experts]: the rows of each expert that hold routes (the rest of its m-blocks is
  // padding). K slices past them are all padding and skipped; the padding rows of the last slice that
  // holds routes are still summed.
  const int32_t* expert_rows = nullptr;
  void* c = nullptr;  // [experts, m, n], fp32 (kStoreF32, kAddF32) or bf16 (kStore)
  Epilogue epilogue = Epilogue::kStoreF32;
  uint64_t wait_timeout_ns = 5'000'000'000ull;  // per wait
  int max_ctas = 0;                             // 0: one per multiprocessor
  TimelineSink timeline;  // where the launch records its spans (a build with POUNCE_TIMELINE); {}: nowhere
};

// Owns the queue ticket and error record of one stream's GEMM launches.
class GroupedGemm {
 public:
  GroupedGemm();
  // Enqueue the GEMM on `stream`; no host synchronization. Throw pounce::Error on invalid arguments.
  void run(const GroupedGemmArgs& args, cudaStream_t stream);
  void run_k_grouped(const KGroupedGemmArgs& args, cudaStream_t stream);
  // After the stream has synchronized: throws pounce::Error if a launch reported a device-side error
  // (a readiness wait that timed out, expert_offsets beyond the A buffer).
  void check_device_errors() { errors_.check(); }

 private:
  DeviceBuffer<uint32_t> ticket_;
  DeviceErrorSlot errors_;
};

}  // namespace pounce::gemm
