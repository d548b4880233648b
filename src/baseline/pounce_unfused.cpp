#include "baseline/pounce_unfused.h"

#include <string>

#include "baseline/moe_kernels.h"
#include "common/cuda_check.h"
#include "common/require.h"

namespace pounce::baseline {

PounceUnfusedMoe::PounceUnfusedMoe(const MoeDims& dims) : dims_(dims) {
  capacity_rows_ = planner::worst_case_capacity(single_rank_config(dims)).max_padded_rows;  // validates dims
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
