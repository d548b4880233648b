// The backward of the MoE layer on one GPU for one rank, as a chain of pounce kernels. From a kept
// forward (KeptForward: its schedule, x rows and gate/up rows before SwiGLU) it gathers each route's dy
// rows; otherwise it replays: plans the routing on the GPU, gathers x and dy rows and recomputes GEMM1.
// Then the four grouped GEMMs of the backward around the SwiGLU backward:
//   da    = dy_rows . W2[e]                        (m-grouped, W2 read N-major)
//   dgu, wa, route dots  = SwiGLU backward (moe/backward/backward_kernels.h)
//   dx_rows = dgu . W13[e]                         (m-grouped, W13 read N-major)
//   dW2[e]  = dy_rows[e]^T . wa[e],  dW13[e] = dgu[e]^T . x_rows[e]      (k-grouped, fp32)
// and the combine of dx rows and route dots back to token order. No host synchronization: a forward and
// this backward can be captured in one CUDA graph. Deterministic: every sum runs in a fixed order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/device_buffer.h"
#include "gemm/grouped_gemm.h"
#include "planner/device_planner.h"
#include "pounce/config.h"
#include "pounce/fused_moe.h"

namespace pounce::moe {

struct BackwardInputs {
  const __nv_bfloat16* x = nullptr;     // [tokens, H], the forward's input
  const int32_t* topk_ids = nullptr;    // [tokens, k]
  const float* topk_weights = nullptr;  // [tokens, k]
  int64_t tokens = 0;
  const __nv_bfloat16* dy = nullptr;   // [tokens, H]
  const __nv_bfloat16* w13 = nullptr;  // [E, 2I, H]
  const __nv_bfloat16* w2 = nullptr;   // [E, H, I]
};

struct BackwardOutputs {
  __nv_bfloat16* dx = nullptr;      // [tokens, H]
  float* d_topk_weights = nullptr;  // [tokens, k]
  void* dw13 = nullptr;             // [E, 2I, H] bf16 or fp32 (see mode)
  void* dw2 = nullptr;              // [E, H, I]
  WeightGradOutput mode = WeightGradOutput::kF32;
};

// What a training forward kept for its backward (moe/fused_layer.h), all in device memory, rows in the
// forward's schedule order (expert-contiguous, padded to m-blocks).
struct KeptForward {
  const int32_t* expert_offsets = nullptr;      // [E + 1], padded
  const int32_t* row_token = nullptr;           // [capacity rows], -1 for padding
  const int32_t* row_k = nullptr;               // [capacity rows]
  const int32_t* route_row = nullptr;           // [tokens, k]: the row of every route
  const __nv_bfloat16* x_rows = nullptr;        // [capacity rows, H]; null: gathered again from x
  const __nv_bfloat16* gate_up_rows = nullptr;  // [capacity rows, 2I], GEMM1 before SwiGLU
};

// The five grouped GEMMs of the chain, in the order it runs them.
enum class BackwardGemm {
  kGateUp,        // h13 = x_rows . W13[e]^T            (GEMM1 again; a replay only)
  kDataDown,      // da = dy_rows . W2[e]
  kDataGateUp,    // dx_rows = dgu . W13[e]
  kWeightDown,    // dW2[e] = dy_rows[e]^T . wa[e]
  kWeightGateUp,  // dW13[e] = dgu[e]^T . x_rows[e]
};

class BackwardChain {
 public:
  // config.ranks must be 1. Buffers are sized for config.max_tokens_per_rank once.
  explicit BackwardChain(const EpConfig& config);
  ~BackwardChain();

  // Enqueues the whole backward on `stream`, from `kept` when given (it must belong to a forward on
  // these inputs), else by replaying the forward's planning and GEMM1. Throws on host-visible bad input;
  // bad routing ids are found on the device and reported by check_device_errors() (that backward's
  // outputs are garbage).
  void run(const BackwardInputs& in, const BackwardOutputs& out, const KeptForward* kept, cudaStream_t stream);
  void check_device_errors();

  // One GEMM alone on the buffers and weights of the last run (benchmarks); weight gradients go to fp32
  // scratch of the chain's own.
  void run_gemm(BackwardGemm which, cudaStream_t stream);

  // Device memory of the chain's buffers (a replay's x and gate/up rows from the first replay on).
  int64_t device_bytes() const;
  // Rows every buffer holds: the schedule's worst case.
  int64_t capacity_rows() const { return rows_; }

  // The gate/up rows of the last run (kept or recomputed), expert-contiguous [capacity rows, 2I] (tests).
  const __nv_bfloat16* gate_up_rows() const { return rows_in_use_.gate_up_rows; }

 private:
  void gemm(BackwardGemm which, void* weight_grad, gemm::Epilogue epilogue, cudaStream_t stream);

  EpConfig config_;
  BackwardInputs last_in_;
  KeptForward rows_in_use_;  // the last run's schedule and rows: kept, or the chain's own
  int64_t rows_ = 0;         // capacity: every row the schedule can hold
  planner::DevicePlanner planner_;
  DeviceBuffer<const int32_t*> ids_table_;
  DeviceBuffer<int32_t> token_count_;
  DeviceBuffer<__nv_bfloat16> x_rows_, h13_;  // a replay's
  DeviceBuffer<__nv_bfloat16> dy_rows_, da_, dgu_, wa_, dx_rows_;
  DeviceBuffer<float> row_weight_, route_dot_, dw_scratch_;
  gemm::GroupedGemm gemm_;
};

}  // namespace pounce::moe
