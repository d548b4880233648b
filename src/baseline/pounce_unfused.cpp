#include "baseline/pounce_unfused.h"

#include <string>

#include "baseline/moe_kernels.h"
#include "common/cuda_check.h"
#include "common/require.h"
#include "formats/quantize_kernel.h"

namespace pounce::baseline {

PounceUnfusedMoe::PounceUnfusedMoe(const MoeDims& dims) : dims_(dims) {
  capacity_rows_ = planner::row_capacity(single_rank_config(dims)).max_padded_rows;  // validates dims
  pool_ = DeviceBuffer<__nv_bfloat16>(capacity_rows_ * dims.hidden);
  hidden_ = DeviceBuffer<__nv_bfloat16>(capacity_rows_ * dims.intermediate);
  out_ = DeviceBuffer<__nv_bfloat16>(capacity_rows_ * dims.hidden);
}

void PounceUnfusedMoe::set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2) {
  POUNCE_REQUIRE(w13 && w2, "PounceUnfusedMoe::set_weights: null weight pointer");
  w13_ = w13;
  w2_ = w2;
}

void PounceUnfusedMoe::set_routing(std::span<const int32_t> topk_ids, int64_t tokens) {
  has_routing_ = false;
  plan_ = make_routing_plan(single_rank_config(dims_), topk_ids, tokens);
  has_routing_ = true;
}

gemm::GroupedGemmArgs PounceUnfusedMoe::gemm_args(Gemm which, const int32_t* expert_offsets,
                                                  const int32_t* expert_rows) const {
  gemm::GroupedGemmArgs g;
  g.timeline = timeline_;
  g.timeline.kernel = uint8_t(timeline_.kernel + (which == Gemm::kGateUp ? 0 : 1));
  g.a_rows = capacity_rows_;
  g.experts = int(dims_.experts);
  g.expert_offsets = expert_offsets;
  g.expert_rows = expert_rows;
  if (which == Gemm::kGateUp) {
    g.a = pool_.data();
    g.b = w13_;
    g.n = 2 * dims_.intermediate;
    g.k = dims_.hidden;
    g.c = hidden_.data();
    g.epilogue = gemm::Epilogue::kSwiGLU;
  } else {
    g.a = hidden_.data();
    g.b = w2_;
    g.n = dims_.hidden;
    g.k = dims_.intermediate;
    g.c = out_.data();
    g.epilogue = gemm::Epilogue::kStore;
  }
  return g;
}

void PounceUnfusedMoe::run_gemm(Gemm which, cudaStream_t stream, const gemm::GemmTuning& tuning) {
  POUNCE_REQUIRE(w13_ && has_routing_, "PounceUnfusedMoe: call set_weights and set_routing first");
  gemm::GroupedGemmArgs args = gemm_args(which, plan_.expert_offsets_dev.data(), plan_.expert_routes_dev.data());
  args.tuning = tuning;
  gemm_.run(args, stream);
}

void PounceUnfusedMoe::quantize_weights_fp8(cudaStream_t stream) {
  POUNCE_REQUIRE(w13_, "PounceUnfusedMoe: call set_weights first");
  const int64_t H = dims_.hidden, I = dims_.intermediate, E = dims_.experts;
  POUNCE_REQUIRE(H % 128 == 0 && I % 128 == 0, "PounceUnfusedMoe: FP8 needs hidden and intermediate in whole ",
                 "128-blocks of the scales; hidden = ", H, ", intermediate = ", I);
  const auto allocate = [](Fp8Buffer& b, int64_t rows, int64_t cols, int64_t scale_rows) {
    if (b.values.size() != size_t(rows * cols)) {
      b.values = DeviceBuffer<uint8_t>(rows * cols);
      b.scales = DeviceBuffer<float>(scale_rows * (cols / 128));
    }
  };
  allocate(w13_fp8_, E * 2 * I, H, E * 2 * I / 128);
  allocate(w2_fp8_, E * H, I, E * H / 128);
  allocate(pool_fp8_, capacity_rows_, H, capacity_rows_);
  allocate(hidden_fp8_, capacity_rows_, I, capacity_rows_);
  formats::quantize_128x128_device(reinterpret_cast<const uint16_t*>(w13_), E * 2 * I, H, w13_fp8_.values.data(),
                                   w13_fp8_.scales.data(), stream);
  formats::quantize_128x128_device(reinterpret_cast<const uint16_t*>(w2_), E * H, I, w2_fp8_.values.data(),
                                   w2_fp8_.scales.data(), stream);
  has_fp8_weights_ = true;
}

gemm::GroupedGemmArgs PounceUnfusedMoe::fp8_gemm_args(Gemm which) const {
  gemm::GroupedGemmArgs g = gemm_args(which, plan_.expert_offsets_dev.data(), plan_.expert_routes_dev.data());
  g.a = nullptr;
  g.b = nullptr;
  const Fp8Buffer& a = which == Gemm::kGateUp ? pool_fp8_ : hidden_fp8_;
  const Fp8Buffer& b = which == Gemm::kGateUp ? w13_fp8_ : w2_fp8_;
  g.fp8 = {a.values.data(), a.scales.data(), b.values.data(), b.scales.data()};
  return g;
}

void PounceUnfusedMoe::run_fp8_step(Fp8Step step, const __nv_bfloat16* x, cudaStream_t stream) {
  POUNCE_REQUIRE(has_fp8_weights_ && has_routing_, "PounceUnfusedMoe: call set_routing and quantize_weights_fp8 first");
  const int64_t rows = plan_.padded_rows;
  // The GEMMs read A's scales K block-major over their a_rows (gemm::Fp8Operands).
  const formats::ScaleLayout a_scales{capacity_rows_};
  switch (step) {
    case Fp8Step::kQuantizeTokens:
      formats::quantize_1x128_gather_device(reinterpret_cast<const uint16_t*>(x), plan_.row_token.data(), rows,
                                            dims_.hidden, pool_fp8_.values.data(), pool_fp8_.scales.data(), stream,
                                            a_scales);
      break;
    case Fp8Step::kGateUp:
      gemm_.run(fp8_gemm_args(Gemm::kGateUp), stream);
      break;
    case Fp8Step::kQuantizeHidden:
      // Padding rows of the hidden buffer hold whatever GEMM1 left there (it skips them); their codes only
      // feed padding rows of GEMM2's output, which the combine never reads.
      formats::quantize_1x128_device(reinterpret_cast<const uint16_t*>(hidden_.data()), rows, dims_.intermediate,
                                     hidden_fp8_.values.data(), hidden_fp8_.scales.data(), stream, a_scales);
      break;
    case Fp8Step::kDown:
      gemm_.run(fp8_gemm_args(Gemm::kDown), stream);
      break;
  }
}

void PounceUnfusedMoe::forward_fp8(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y,
                                   cudaStream_t stream) {
  for (Fp8Step step : {Fp8Step::kQuantizeTokens, Fp8Step::kGateUp, Fp8Step::kQuantizeHidden, Fp8Step::kDown})
    run_fp8_step(step, x, stream);
  weighted_combine(out_.data(), plan_.route_row.data(), topk_weights, plan_.tokens, dims_.topk, dims_.hidden, y,
                   stream);
}

void PounceUnfusedMoe::forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y,
                               cudaStream_t stream) {
  POUNCE_REQUIRE(w13_ && has_routing_, "PounceUnfusedMoe: call set_weights and set_routing first");
  permute_rows(x, plan_.row_token.data(), plan_.padded_rows, dims_.hidden, pool_.data(), stream);
  gemm_.run(gemm_args(Gemm::kGateUp, plan_.expert_offsets_dev.data(), plan_.expert_routes_dev.data()), stream);
  gemm_.run(gemm_args(Gemm::kDown, plan_.expert_offsets_dev.data(), plan_.expert_routes_dev.data()), stream);
  weighted_combine(out_.data(), plan_.route_row.data(), topk_weights, plan_.tokens, dims_.topk, dims_.hidden, y,
                   stream);
}

void PounceUnfusedMoe::forward_with_device_schedule(const __nv_bfloat16* x, const int32_t* topk_ids, int64_t tokens,
                                                    const float* topk_weights, __nv_bfloat16* y, cudaStream_t stream) {
  POUNCE_REQUIRE(w13_, "PounceUnfusedMoe: call set_weights first");
  POUNCE_REQUIRE(tokens >= 0 && tokens <= dims_.max_tokens && (tokens == 0 || topk_ids), "PounceUnfusedMoe: ", tokens,
                 " tokens (at most ", dims_.max_tokens, ") with topk_ids ", topk_ids ? "set" : "null");
  if (!device_planner_) {
    // One minibatch row count is as good as another: the unfused GEMMs ignore minibatches.
    device_planner_ = std::make_unique<planner::DevicePlanner>(single_rank_config(dims_), kBlockM);
    planner_ids_ = DeviceBuffer<const int32_t*>(1);
    planner_tokens_ = DeviceBuffer<int32_t>(1);
  }
  if (topk_ids != planned_ids_ || tokens != planned_tokens_) {
    // In stream order: an earlier forward on `stream` still plans from the old values. (From pageable
    // memory the copy is staged before the call returns, so the locals may go.)
    const int32_t* ids_table[1] = {topk_ids};
    const int32_t count = int32_t(tokens);
    CUDA_CHECK(cudaMemcpyAsync(planner_ids_.data(), ids_table, sizeof(ids_table), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemcpyAsync(planner_tokens_.data(), &count, sizeof(count), cudaMemcpyHostToDevice, stream));
    planned_ids_ = topk_ids;
    planned_tokens_ = tokens;
  }
  const planner::DevicePlanner& plan = *device_planner_;
  device_planner_->plan(0, planner_ids_.data(), planner_tokens_.data(), stream);
  // The schedule's length is on the device: permute every row the capacity allows (padding rows and
  // rows past the schedule become zeros).
  permute_rows(x, plan.row_token(), capacity_rows_, dims_.hidden, pool_.data(), stream);
  gemm_.run(gemm_args(Gemm::kGateUp, plan.expert_offsets(), plan.expert_routes()), stream);
  gemm_.run(gemm_args(Gemm::kDown, plan.expert_offsets(), plan.expert_routes()), stream);
  weighted_combine(out_.data(), plan.route_row(), topk_weights, tokens, dims_.topk, dims_.hidden, y, stream);
}

void PounceUnfusedMoe::check_device_errors() {
  // Both error slots are read (and cleared) before either throws: a GEMM error must not wait for a
  // later, unrelated call.
  std::string planner_error;
  if (device_planner_) {
    try {
      device_planner_->check_device_errors();
    } catch (const Error& e) {
      planner_error = e.what();
    }
  }
  if (!planner_error.empty()) {
    try {
      gemm_.check_device_errors();
    } catch (const Error& e) {
      planner_error += std::string("; and ") + e.what();
    }
    throw Error(planner_error);
  }
  gemm_.check_device_errors();
}

}  // namespace pounce::baseline
