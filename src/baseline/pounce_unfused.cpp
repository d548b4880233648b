#include "baseline/pounce_unfused.h"

#include "baseline/moe_kernels.h"
#include "common/error.h"

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

gemm::GroupedGemmArgs PounceUnfusedMoe::gemm_args(Gemm which) const {
  POUNCE_REQUIRE(w13_ && has_routing_, "PounceUnfusedMoe: call set_weights and set_routing first");
  gemm::GroupedGemmArgs g;
  g.a_rows = capacity_rows_;
  g.experts = int(dims_.experts);
  g.expert_offsets = plan_.expert_offsets_dev.data();
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
  gemm::GroupedGemmArgs args = gemm_args(which);
  args.tuning = tuning;
  gemm_.run(args, stream);
}

void PounceUnfusedMoe::forward(const __nv_bfloat16* x, const float* topk_weights, __nv_bfloat16* y,
                               cudaStream_t stream) {
  const gemm::GroupedGemmArgs gate_up = gemm_args(Gemm::kGateUp);  // checks the set-up before any launch
  permute_rows(x, plan_.row_token.data(), plan_.padded_rows, dims_.hidden, pool_.data(), stream);
  gemm_.run(gate_up, stream);
  gemm_.run(gemm_args(Gemm::kDown), stream);
  weighted_combine(out_.data(), plan_.route_row.data(), topk_weights, plan_.tokens, dims_.topk, dims_.hidden, y,
                   stream);
}

}  // namespace pounce::baseline
