// The unfused MoE forward built from cuBLAS, as today's training stacks run it: permute tokens into
// expert-contiguous rows, GEMM1 (gate/up) per expert, SwiGLU, GEMM2 (down) per expert, then a
// weighted combine back to token order. The baseline pounce's kernels are measured against.
//
// The routing plan (host planner) is built and uploaded by set_routing(), outside forward(): a loop
// of cuBLAS GEMMs needs per-expert row counts on the host, which a real stack pays for with a
// device-to-host sync every step. Timing forward() alone therefore favours this baseline.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <vector>

#include "baseline/routing_plan.h"
#include "common/device_buffer.h"

namespace pounce::baseline {

struct MoeDims {
  int64_t max_tokens = 0;
  int64_t hidden = 0;
  int64_t intermediate = 0;
  int64_t experts = 0;
  int64_t topk = 0;
};
EpConfig single_rank_config(const MoeDims& dims);

enum class GemmCalls {
  kLoop,            // one cublasGemmEx per expert (Megatron's sequential MLP)
  kGroupedBatched,  // one cublasGemmGroupedBatchedEx for all experts
};
const char* gemm_calls_name(GemmCalls calls);

enum class Gemm { kGateUp = 0, kDown = 1 };

class CublasMoe {
 public:
  explicit CublasMoe(const MoeDims& dims);
  ~CublasMoe();
  CublasMoe(const CublasMoe&) = delete;
  CublasMoe& operator=(const CublasMoe&) = delete;

  // w13 [E, 2I, H] (gate/up interleaved in groups of 8), w2 [E, H, I]; device pointers kept, not copied.
  void set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2);
  // topk_ids [tokens, k] (host). Validates them, plans, and uploads the plan.
  void set_routing(std::span<const int32_t> topk_ids, int64_t tokens);
  // x [tokens, H], topk_weights [tokens, k], y [tokens, H]: device pointers. No host synchronization.
  void forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, GemmCalls calls,
               cudaStream_t stream);
  // One of the two GEMMs alone, on the buffers the last forward() filled (GEMM benchmarks).
  void run_gemm(Gemm gemm, GemmCalls calls, cudaStream_t stream);

  const RoutingPlan& plan() const { return plan_; }
  // What the last forward() or run_gemm() left, expert-contiguous, padded to 128-row m-blocks (the GEMMs
  // skip padding rows): GEMM1's gate/up [rows, 2I], the SwiGLU output [rows, I], GEMM2's output [rows, H].
  const __nv_bfloat16* gate_up() const { return h13_.data(); }
  const __nv_bfloat16* hidden() const { return hidden_.data(); }
  const __nv_bfloat16* expert_out() const { return out_.data(); }

 private:
  MoeDims dims_;
  cublasHandle_t handle_ = nullptr;
  const __nv_bfloat16* w13_ = nullptr;
  const __nv_bfloat16* w2_ = nullptr;
  bool has_routing_ = false;
  RoutingPlan plan_;
  DeviceBuffer<__nv_bfloat16> pool_, h13_, hidden_, out_;
  // cuBLAS arguments per GEMM (index Gemm), non-empty experts only: the grouped call reads the device
  // pointer arrays, the loop the host copies.
  struct Calls {
    std::vector<int> m, n, k, group_size;
    std::vector<cublasOperation_t> trans_a, trans_b;
    std::vector<float> alpha, beta;
    std::vector<const void*> a_host, b_host;  // weights, activations
    std::vector<void*> c_host;
    DeviceBuffer<const void*> a, b;
    DeviceBuffer<void*> c;
  } calls_[2];
};

}  // namespace pounce::baseline
