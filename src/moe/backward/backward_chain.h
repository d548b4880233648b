// The backward of the MoE layer on one GPU for one rank, as a chain of pounce kernels: plan the routing
// on the GPU, gather each route's x and dy rows, recompute GEMM1 (gate/up), then the four grouped GEMMs
// of the backward around the SwiGLU backward:
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

// The five grouped GEMMs of the chain, in the order it runs them.
enum class BackwardGemm {
  kGateUp,        // h13 = x_rows . W13[e]^T            (GEMM1 again)
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

  // Enqueues the whole backward on `stream`. Throws on host-visible bad input; bad routing ids are found on
  // the device and reported by check_device_errors() (that backward's outputs are garbage).
  void run(const BackwardInputs& in, const BackwardOutputs& out, cudaStream_t stream);
  void check_device_errors();

  // One GEMM alone on the buffers and weights of the last run (benchmarks); weight gradients go to fp32
  // scratch of the chain's own.
  void run_gemm(BackwardGemm which, cudaStream_t stream);

  // Device memory of the chain's buffers.
  int64_t device_bytes() const;

  // The recomputed gate/up rows of the last run, expert-contiguous [capacity rows, 2I] (tests).
  const __nv_bfloat16* gate_up_rows() const { return h13_.data(); }

 private:
  void gemm(BackwardGemm which, void* weight_grad, gemm::Epilogue epilogue, cudaStream_t stream);

  EpConfig config_;
  BackwardInputs last_in_;
  int64_t rows_ = 0;  // capacity: every row the schedule can hold
  planner::DevicePlanner planner_;
  DeviceBuffer<const int32_t*> ids_table_;
  DeviceBuffer<int32_t> token_count_;
  DeviceBuffer<__nv_bfloat16> x_rows_, dy_rows_, h13_, da_, dgu_, wa_, dx_rows_;
  DeviceBuffer<float> row_weight_, route_dot_, dw_scratch_;
  gemm::GroupedGemm gemm_;
};

}  // namespace pounce::moe
