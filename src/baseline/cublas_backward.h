// The four GEMMs of the MoE backward as training stacks run them today: one cuBLAS call per expert over
// its rows (bf16 inputs, fp32 accumulation; weight gradients written in fp32). A yardstick for pounce's
// backward GEMMs (moe/backward/backward_chain.h) on the same schedule: timing only, on row buffers of
// its own filled with random values.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "baseline/cublas_moe.h"
#include "baseline/routing_plan.h"
#include "common/device_buffer.h"
#include "moe/backward/backward_chain.h"

namespace pounce::baseline {

class CublasBackwardGemms {
 public:
  // plan: the host schedule of the routing (its per-expert row counts and offsets); w13 [E, 2I, H] and
  // w2 [E, H, I] are kept as pointers.
  CublasBackwardGemms(const MoeDims& dims, const RoutingPlan& plan, const __nv_bfloat16* w13, const __nv_bfloat16* w2,
                      cudaStream_t stream);
  ~CublasBackwardGemms();
  CublasBackwardGemms(const CublasBackwardGemms&) = delete;
  CublasBackwardGemms& operator=(const CublasBackwardGemms&) = delete;

  // One of the backward's four GEMMs (not kGateUp, which is the forward's) for every expert with rows.
  void run(moe::BackwardGemm which, cudaStream_t stream);

 private:
  MoeDims dims_;
  const RoutingPlan& plan_;
  const __nv_bfloat16 *w13_, *w2_;
  cublasHandle_t handle_ = nullptr;
  DeviceBuffer<__nv_bfloat16> x_rows_, dy_rows_, dgu_, wa_, da_, dx_rows_;
  DeviceBuffer<float> dw13_, dw2_;
};

}  // namespace pounce::baseline
