// pounce's own unfused MoE forward: the steps of the cuBLAS baseline with pounce's grouped GEMM engine,
// SwiGLU fused into GEMM1's epilogue: permute, GEMM1 + SwiGLU, GEMM2, weighted combine, four launches
// back to back. The fused megakernel must never be slower than this chain.
//
// FP8: forward_fp8() runs the same chain in E4M3 with blockwise scales (formats/blockwise.h): the tokens
// gathered and quantized (1 x 128) in one pass, the FP8 GEMM1 with SwiGLU (bf16 hidden rows), the hidden
// rows quantized (1 x 128), the FP8 GEMM2, the combine. Its weights are quantized (128 x 128) by
// quantize_weights_fp8(), once per weight update.
//
// Two ways to get the schedule: set_routing() plans on the host, once, outside the forward (free for
// the timed chain; routing copied to the host every step in training); forward_with_device_schedule()
// plans on the GPU as the first step of every forward (planner::DevicePlanner, three launches), from
// routing in device memory, as the fused layer does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <memory>
#include <span>

#include "baseline/cublas_moe.h"
#include "baseline/routing_plan.h"
#include "gemm/grouped_gemm.h"
#include "planner/device_planner.h"

namespace pounce::baseline {

class PounceUnfusedMoe {
 public:
  explicit PounceUnfusedMoe(const MoeDims& dims);

  void set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2);
  void set_routing(std::span<const int32_t> topk_ids, int64_t tokens);
  void forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream);
  // The whole chain from device routing: schedule (device planner), permute, GEMM1, GEMM2, combine; no
  // host sync (topk_ids [tokens, k] in device memory; a new pointer or count is copied to the planner
  // in stream order). Bad routing ids are reported by check_device_errors(); that forward's y is garbage.
  void forward_with_device_schedule(const __nv_bfloat16* x, const int32_t* topk_ids, int64_t tokens,
                                    const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream);
  // One GEMM alone on the buffers the last forward() filled (GEMM benchmarks).
  void run_gemm(Gemm gemm, cudaStream_t stream, const gemm::GemmTuning& tuning = {});

  // Quantizes the weights set_weights() named (call again after they change) and allocates the FP8 row
  // buffers. hidden and intermediate must be multiples of 128.
  void quantize_weights_fp8(cudaStream_t stream);
  // After set_routing() and quantize_weights_fp8().
  void forward_fp8(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream);
  // The FP8 chain's steps alone, on what the last forward_fp8() left (what each costs).
  enum class Fp8Step { kQuantizeTokens, kGateUp, kQuantizeHidden, kDown };
  void run_fp8_step(Fp8Step step, const __nv_bfloat16* x, cudaStream_t stream);
  // After synchronizing: throws if a GEMM reported a device-side error.
  void check_device_errors();
  // Its GEMMs record their spans there from now on (a build with POUNCE_TIMELINE), GEMM1 tagged
  // sink.kernel and GEMM2 sink.kernel + 1; {}: stop.
  void set_timeline(const TimelineSink& sink) { timeline_ = sink; }

  const RoutingPlan& plan() const { return plan_; }
  // What the last forward() or run_gemm() left, expert-contiguous: the permuted tokens, GEMM1's SwiGLU
  // output [rows, I] and GEMM2's output [rows, H].
  const __nv_bfloat16* pool() const { return pool_.data(); }  // the permuted tokens [rows, H]
  const __nv_bfloat16* hidden() const { return hidden_.data(); }
  const __nv_bfloat16* expert_out() const { return out_.data(); }

 private:
  gemm::GroupedGemmArgs gemm_args(Gemm which, const int32_t* expert_offsets, const int32_t* expert_rows) const;
  gemm::GroupedGemmArgs fp8_gemm_args(Gemm which) const;

  // E4M3 rows or weights and their fp32 block scales.
  struct Fp8Buffer {
    DeviceBuffer<uint8_t> values;
    DeviceBuffer<float> scales;
  };

  MoeDims dims_;
  int64_t capacity_rows_ = 0;
  const __nv_bfloat16* w13_ = nullptr;
  const __nv_bfloat16* w2_ = nullptr;
  RoutingPlan plan_;
  bool has_routing_ = false;
  DeviceBuffer<__nv_bfloat16> pool_, hidden_, out_;
  Fp8Buffer pool_fp8_, hidden_fp8_, w13_fp8_, w2_fp8_;  // after quantize_weights_fp8()
  bool has_fp8_weights_ = false;
  gemm::GroupedGemm gemm_;
  TimelineSink timeline_;
  // forward_with_device_schedule's planner and its inputs (a table of one pointer, one token count).
  std::unique_ptr<planner::DevicePlanner> device_planner_;
  DeviceBuffer<const int32_t*> planner_ids_;
  DeviceBuffer<int32_t> planner_tokens_;
  const int32_t* planned_ids_ = nullptr;
  int64_t planned_tokens_ = -1;
};

}  // namespace pounce::baseline
