// Grouped GEMM for the expert FFN on Hopper (sm_90a): for every local expert e,
//   C[rows of e] = epilogue( A[rows of e] . B[e]^T )
// A is the expert-contiguous token pool [rows, K] bf16 (each expert's rows start on a 128-row
// m-block), B the expert weights [E, N, K] bf16 (K-major), C [rows, N] (plain) or [rows, N/2] (SwiGLU).
//
// Persistent CTAs take tiles (expert, m-block, n-block) of 128 x 256 from a device queue. Before
// loading A for a tile, a CTA waits (acquire, bounded) until that m-block's readiness counter reaches
// `ready_target`: the megakernel's dispatch bumps these counters; stand-alone callers pass none.
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

namespace pounce::gemm {

// Consumer warpgroups of the engine's CTA (gemm/gemm_pipeline.cuh), each computing half of a tile's rows
// and adding 1 to the tile's completion counter: a finished tile counts kConsumerWarpgroups.
inline constexpr int kConsumerWarpgroups = 2;

// TMA boxes of the C stores: 64 bf16 (128 bytes, one swizzle row) wide and one consumer's rows high.
inline constexpr int kStoreBoxCols = 64;
inline constexpr int kStoreBoxRows = kBlockM / kConsumerWarpgroups;

enum class Epilogue {
  kStore,   // C = A . B^T                                  [rows, N]
  kSwiGLU,  // C = silu(gate) * up, gate/up interleaved in groups of 8 along N   [rows, N/2]
};

// Scheduling knobs. The default is the measured best on the H200 (docs/grouped_gemm.md); the
// benchmark sweeps the alternatives so that stays checked.
struct GemmTuning {
  // M-blocks of one expert walked together, m-fastest, before moving to the next band (L2 locality).
  int band_m_blocks = 16;
};

struct GroupedGemmArgs {
  const __nv_bfloat16* a = nullptr;  // [a_rows, k]
  int64_t a_rows = 0;                // rows of the A buffer (capacity), a multiple of 128
  const __nv_bfloat16* b = nullptr;  // [experts, n, k]
  int experts = 0;
  int64_t n = 0, k = 0;        // multiples of 64
  __nv_bfloat16* c = nullptr;  // [a_rows, n] or [a_rows, n / 2]
  Epilogue epilogue = Epilogue::kStore;
  // Device [experts + 1]: first row of each expert, multiples of 128; [experts] = rows in use.
  const int32_t* expert_offsets = nullptr;
  // Optional device [a_rows]: every output row is multiplied by its scale (the router weight).
  const float* row_scale = nullptr;
  // Optional device [a_rows / 128] readiness counters; tiles of m-block b wait for counter >= ready_target.
  const uint32_t* m_block_ready = nullptr;
  uint32_t ready_target = 0;
  GemmTuning tuning;
  uint64_t wait_timeout_ns = 5'000'000'000ull;  // per wait
  int max_ctas = 0;                             // 0: one per multiprocessor
};

// Owns the queue ticket and error record of one stream's GEMM launches.
class GroupedGemm {
 public:
  GroupedGemm();
  // Enqueues the GEMM on `stream`; no host synchronization. Throws pounce::Error on invalid arguments.
  void run(const GroupedGemmArgs& args, cudaStream_t stream);
  // After the stream has synchronized: throws pounce::Error if a launch reported a device-side error
  // (a readiness wait that timed out, expert_offsets beyond the A buffer).
  void check_device_errors() { errors_.check(); }

 private:
  DeviceBuffer<uint32_t> ticket_;
  DeviceErrorSlot errors_;
};

}  // namespace pounce::gemm
