// pounce's own unfused MoE forward: the steps of the cuBLAS baseline with pounce's grouped GEMM engine,
// SwiGLU fused into GEMM1's epilogue: permute, GEMM1 + SwiGLU, GEMM2, weighted combine, four launches
// back to back. The fused megakernel must never be slower than this chain.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <span>

#include "baseline/cublas_moe.h"
#include "baseline/routing_plan.h"
#include "gemm/grouped_gemm.h"

namespace pounce::baseline {

class PounceUnfusedMoe {
 public:
  explicit PounceUnfusedMoe(const MoeDims& dims);

  void set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2);
  void set_routing(std::span<const int32_t> topk_ids, int64_t tokens);
  void forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream);
  // One GEMM alone on the buffers the last forward() filled (GEMM benchmarks).
  void run_gemm(Gemm gemm, cudaStream_t stream, const gemm::GemmTuning& tuning = {});
  // After synchronizing: throws if a GEMM reported a device-side error.
  void check_device_errors() { gemm_.check_device_errors(); }

  const RoutingPlan& plan() const { return plan_; }
  const __nv_bfloat16* hidden() const { return hidden_.data(); }

 private:
  gemm::GroupedGemmArgs gemm_args(Gemm which) const;

  MoeDims dims_;
  int64_t capacity_rows_ = 0;
  const __nv_bfloat16* w13_ = nullptr;
  const __nv_bfloat16* w2_ = nullptr;
  RoutingPlan plan_;
  bool has_routing_ = false;
  DeviceBuffer<__nv_bfloat16> pool_, hidden_, out_;
  gemm::GroupedGemm gemm_;
};

}  // namespace pounce::baseline
