#include "moe/backward/backward_chain.h"

#include <functional>
#include <string>
#include <tuple>
#include <utility>

#include "common/device_pointer.h"
#include "formats/quantize_kernel.h"
#include "moe/backward/backward_kernels.h"

namespace pounce::moe {

// Buffers a backward needs only in some modes are made by the first backward that needs them, which
// must not be inside a CUDA graph capture (the allocation would not be replayed).
template <typename T>
void BackwardChain::allocate(DeviceBuffer<T>& buffer, int64_t count, const char* what, cudaStream_t stream) {
  if (buffer.size() > 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  POUNCE_REQUIRE(capture == cudaStreamCaptureStatusNone, "MoE backward: the first backward that needs its ", what,
                 " allocates them, which a CUDA graph capture cannot: run one backward of the same kind (from a kept "
                 "forward, or replaying its forward) before capturing");
  try {
    buffer = DeviceBuffer<T>(count);
  } catch (const Error& e) {
    POUNCE_FAIL("MoE backward: its ", what, " (", rows_, " rows: ", planner::describe_capacity(config_),
                ") do not fit: ", e.what(), "; a smaller max_routes_per_rank or max_tokens_per_rank shrinks them");
  }
}

BackwardChain::BackwardChain(const EpConfig& config, std::span<__nv_bfloat16* const> slots,
                             std::shared_ptr<BackwardRowBuffers> rows)
    : config_(config),
      slots_(slots.begin(), slots.end()),
      planner_(config, kBlockM),
      buffers_(rows ? std::move(rows) : std::make_shared<BackwardRowBuffers>()) {
  check_config(config);
  POUNCE_REQUIRE(config.ranks == 1 || int(slots.size()) == config.ranks, "MoE backward: ", config.ranks,
                 " ranks need every rank's dx slots, got ", slots.size());
  rows_ = planner_.capacity().max_padded_rows;
  ids_table_ = DeviceBuffer<const int32_t*>(config.ranks);
  token_count_ = DeviceBuffer<int32_t>(config.ranks);
}

BackwardChain::~BackwardChain() = default;

void BackwardChain::check(int rank, std::span<const BackwardSource> sources, const ExpertGradients& experts) const {
  const int P = config_.ranks;
  POUNCE_REQUIRE(rank >= 0 && rank < P, "MoE backward: rank ", rank, " of ", P);
  POUNCE_REQUIRE(int(sources.size()) == P, "MoE backward: got ", sources.size(),
                 " source ranks' tensors, the layer has ", P);
  for (int s = 0; s < P; ++s) check_source(s, sources[s]);
  check_experts(rank, experts);
}

void BackwardChain::check_source(int rank, const BackwardSource& src) const {
  const int64_t H = config_.hidden, k = config_.topk, T = src.tokens;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_REQUIRE(T >= 0 && T <= config_.max_tokens_per_rank, "MoE backward: rank ", rank, " has ", T,
                 " tokens, outside [0, max_tokens_per_rank = ", config_.max_tokens_per_rank, "]");
  require_device_tensor(src.x, T * H * 2, device, "x", rank);
  require_device_tensor(src.topk_ids, T * k * 4, device, "topk_ids", rank);
  require_device_tensor(src.topk_weights, T * k * 4, device, "topk_weights", rank);
  require_device_tensor(src.dy, T * H * 2, device, "dy", rank);
  require_device_tensor(src.dx, T * H * 2, device, "dx", rank);
  require_device_tensor(src.d_topk_weights, T * k * 4, device, "d_topk_weights", rank);
}

void BackwardChain::check_experts(int rank, const ExpertGradients& experts) const {
  const int64_t H = config_.hidden, I = config_.intermediate, E = config_.local_experts();
  POUNCE_REQUIRE(rank >= 0 && rank < config_.ranks, "MoE backward: rank ", rank, " of ", config_.ranks);
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  require_device_tensor(experts.w13, E * 2 * I * H * 2, device, "w13", rank);
  require_device_tensor(experts.w2, E * H * I * 2, device, "w2", rank);
  const int64_t dw_bytes = experts.mode == WeightGradOutput::kBf16 ? 2 : 4;
  require_device_tensor(experts.dw13, E * 2 * I * H * dw_bytes, device, "dw13", rank);
  require_device_tensor(experts.dw2, E * H * I * dw_bytes, device, "dw2", rank);
  if (const Fp8TransposedWeights* fp8 = experts.fp8) {
    POUNCE_REQUIRE(fp8->experts() == E && fp8->hidden() == H && fp8->intermediate() == I, "MoE backward: rank ", rank,
                   "'s FP8 weights are of ", fp8->experts(), " experts, H ", fp8->hidden(), ", I ", fp8->intermediate(),
                   "; the layer has ", E, ", ", H, ", ", I);
    POUNCE_REQUIRE(fp8->refreshed_from(experts.w13, experts.w2), "MoE backward: rank ", rank,
                   "'s FP8 weights were not refreshed from its w13 and w2 (Fp8TransposedWeights::refresh)");
  }
  POUNCE_REQUIRE(!experts.fp8_weight_gradients || (H % 128 == 0 && I % 128 == 0),
                 "MoE backward: FP8 weight gradients need H and I multiples of 128; H = ", H, ", I = ", I);
}

void BackwardChain::allocate_transposed_rows(cudaStream_t stream) {
  const int64_t H = config_.hidden, I = config_.intermediate;
  for (const auto& [rows, cols] : {std::pair(&buffers_->dy_t, H), std::pair(&buffers_->wa_t, I),
                                   std::pair(&buffers_->dgu_t, 2 * I), std::pair(&buffers_->x_t, H)}) {
    allocate(rows->q, rows_ * cols, "FP8 transposed route rows", stream);
    allocate(rows->scales, rows_ / 128 * cols, "FP8 transposed route rows", stream);
  }
}

// Each route-row buffer the weight gradients read, quantized along its rows into its transpose.
void BackwardChain::quantize_transposed_rows(cudaStream_t stream) {
  const int64_t H = config_.hidden, I = config_.intermediate;
  const std::tuple<const __nv_bfloat16*, TransposedRows*, int64_t> buffers[] = {
      {route_rows_.dy, &buffers_->dy_t, H},
      {route_rows_.wa, &buffers_->wa_t, I},
      {route_rows_.dgu, &buffers_->dgu_t, 2 * I},
      {rows_in_use_.x_rows, &buffers_->x_t, H}};
  // Only the schedule's rows in use: the k-grouped GEMMs read no further (a capacity of many ranks' worst
  // case may hold several times as many).
  const int32_t* rows_in_use = rows_in_use_.expert_offsets + config_.local_experts();
  for (const auto& [rows, to, cols] : buffers)
    formats::quantize_1x128_transposed_device(reinterpret_cast<const uint16_t*>(rows), rows_, cols, to->q.data(),
                                              to->scales.data(), stream, rows_in_use);
}

void BackwardChain::run(int rank, std::span<const BackwardSource> sources, const ExpertGradients& experts,
                        const KeptForward* kept, cudaStream_t stream) {
  check(rank, sources, experts);
  const int P = config_.ranks;
  const int64_t H = config_.hidden, I = config_.intermediate, k = config_.topk;
  backward::RouteSources from{};
  backward::RouteTargets to{};
  for (int s = 0; s < P; ++s) {
    from.topk_ids[s] = sources[s].topk_ids;
    from.tokens[s] = int32_t(sources[s].tokens);
    from.x[s] = sources[s].x;
    from.dy[s] = sources[s].dy;
    from.topk_weights[s] = sources[s].topk_weights;
    to.slots[s] = P > 1 ? slots_[s] : nullptr;
    to.d_topk_weights[s] = sources[s].d_topk_weights;
  }

  last_experts_ = experts;
  allocate(buffers_->dy_rows, rows_ * H, "route rows", stream);
  allocate(buffers_->da, rows_ * I, "route rows", stream);
  allocate(buffers_->dgu, rows_ * 2 * I, "route rows", stream);
  allocate(buffers_->wa, rows_ * I, "route rows", stream);
  allocate(buffers_->dx_rows, rows_ * H, "route rows", stream);
  allocate(buffers_->row_weight, rows_, "route rows", stream);
  allocate(buffers_->route_dot, rows_, "route rows", stream);
  route_rows_ = {buffers_->dy_rows.data(), buffers_->dgu.data(), buffers_->wa.data()};
  // A replay plans again, gathers the x rows and recomputes the gate/up rows in the chain's own buffers;
  // a kept forward may still need its x rows gathered (its ring did not hold them all).
  const bool gather_x = kept == nullptr || kept->x_rows == nullptr;
  if (gather_x) allocate(buffers_->x_rows, rows_ * H, "x rows", stream);
  if (kept == nullptr) allocate(buffers_->h13, rows_ * 2 * I, "gate/up rows", stream);
  if (experts.fp8_weight_gradients) allocate_transposed_rows(stream);
  const bool fp8 = experts.fp8 != nullptr;
  if (fp8) {
    allocate(buffers_->dy_fp8, rows_ * H, "FP8 route rows", stream);
    allocate(buffers_->dy_scale, rows_ * H / 128, "FP8 route rows", stream);
    allocate(buffers_->dgu_fp8, rows_ * 2 * I, "FP8 route rows", stream);
    allocate(buffers_->dgu_scale, rows_ * 2 * I / 128, "FP8 route rows", stream);
  }
  if (kept != nullptr) {
    rows_in_use_ = *kept;
  } else {
    backward::set_plan_inputs(ids_table_.data(), token_count_.data(), from, P, stream);
    planner_.plan(rank, ids_table_.data(), token_count_.data(), stream);
    rows_in_use_ = {planner_.expert_offsets(),
                    planner_.expert_routes(),
                    planner_.row_source_rank(),
                    planner_.row_token(),
                    planner_.row_k(),
                    planner_.route_row(),
                    nullptr,
                    buffers_->h13.data()};
  }
  if (gather_x) rows_in_use_.x_rows = buffers_->x_rows.data();
  const KeptForward& f = rows_in_use_;
  // Every route's dy rows and router weights, and its x rows unless kept.
  // FP8 data gradients: their A operands quantized as the kernels write the bf16 rows (which the weight
  // gradients read).
  const backward::Fp8Rows dy_fp8 =
      fp8 ? backward::Fp8Rows{buffers_->dy_fp8.data(), buffers_->dy_scale.data()} : backward::Fp8Rows{};
  const backward::Fp8Rows dgu_fp8 =
      fp8 ? backward::Fp8Rows{buffers_->dgu_fp8.data(), buffers_->dgu_scale.data()} : backward::Fp8Rows{};
  backward::gather_route_rows(from, f.row_source_rank, f.row_token, f.row_k, rows_, H, k, f.x_rows, gather_x,
                              buffers_->dy_rows.data(), buffers_->row_weight.data(), stream, dy_fp8);
  if (kept == nullptr) gemm(BackwardGemm::kGateUp, nullptr, gemm::Epilogue::kStore, stream);
  gemm(BackwardGemm::kDataDown, nullptr, gemm::Epilogue::kStore, stream);
  backward::swiglu_backward_rows(f.gate_up_rows, buffers_->da.data(), buffers_->row_weight.data(), f.row_token, rows_,
                                 I, buffers_->dgu.data(), buffers_->wa.data(), buffers_->route_dot.data(), stream,
                                 dgu_fp8);
  gemm(BackwardGemm::kDataGateUp, nullptr, gemm::Epilogue::kStore, stream);
  if (P == 1)
    backward::combine_gradients(buffers_->dx_rows.data(), buffers_->route_dot.data(), f.route_row, sources[0].tokens, k,
                                H, sources[0].dx, sources[0].d_topk_weights, stream);
  else
    backward::scatter_route_rows(buffers_->dx_rows.data(), buffers_->route_dot.data(), f.row_source_rank, f.row_token,
                                 f.row_k, rows_, H, k, to, stream);

  weight_gradients(experts, stream);
}

void BackwardChain::run_weight_gradients(int rank, std::span<const __nv_bfloat16* const> x,
                                         const ExpertGradients& experts, const KeptForward& kept, const RouteRows& rows,
                                         cudaStream_t stream) {
  POUNCE_REQUIRE(experts.fp8 == nullptr,
                 "MoE backward: FP8 weights are for run()'s data gradients; the weight gradients alone take none");
  check_experts(rank, experts);
  POUNCE_REQUIRE(int(x.size()) == config_.ranks, "MoE backward: got ", x.size(), " source ranks' x, the layer has ",
                 config_.ranks);
  const int64_t H = config_.hidden, k = config_.topk;
  if (experts.fp8_weight_gradients) allocate_transposed_rows(stream);
  backward::RouteSources from{};
  for (int s = 0; s < config_.ranks; ++s) from.x[s] = x[s];  // x rows only: no dy, no weights
  last_experts_ = experts;
  rows_in_use_ = kept;
  route_rows_ = rows;
  // x rows: the caller's (padding rows zero), or gathered with zero padding rows.
  if (kept.x_rows == nullptr) {
    allocate(buffers_->x_rows, rows_ * H, "x rows", stream);
    rows_in_use_.x_rows = buffers_->x_rows.data();
    backward::gather_route_rows(from, kept.row_source_rank, kept.row_token, kept.row_k, rows_, H, k,
                                rows_in_use_.x_rows, true, nullptr, nullptr, stream);
  }
  weight_gradients(experts, stream);
}

// Reductions over each expert's rows in fp32. A tile sums all of an element's rows (no split K), so bf16
// output is that fp32 sum rounded once, in the epilogue.
void BackwardChain::weight_gradients(const ExpertGradients& experts, cudaStream_t stream) {
  const gemm::Epilogue epilogue = weight_grad_epilogue(experts.mode);
  if (experts.fp8_weight_gradients) quantize_transposed_rows(stream);
  gemm(BackwardGemm::kWeightDown, experts.dw2, epilogue, stream);
  gemm(BackwardGemm::kWeightGateUp, experts.dw13, epilogue, stream);
}

void BackwardChain::finish(std::span<const BackwardSource> sources, cudaStream_t stream) {
  if (config_.ranks == 1) return;  // run() summed them
  POUNCE_REQUIRE(int(sources.size()) == config_.ranks, "MoE backward: got ", sources.size(),
                 " source ranks' tensors, the layer has ", config_.ranks);
  for (int s = 0; s < config_.ranks; ++s)
    backward::combine_gradients(slots_[s], nullptr, nullptr, sources[s].tokens, config_.topk, config_.hidden,
                                sources[s].dx, nullptr, stream);
}

int64_t BackwardChain::device_bytes() const {
  return planner_.device_bytes() + int64_t(ids_table_.bytes() + token_count_.bytes() + dw_scratch_.bytes());
}

void BackwardChain::run_gemm(BackwardGemm which, cudaStream_t stream, WeightGradOutput output) {
  POUNCE_REQUIRE(last_experts_.w13 != nullptr, "MoE backward: run_gemm needs an earlier run()");
  POUNCE_REQUIRE(which != BackwardGemm::kGateUp || buffers_->h13.size() > 0,
                 "MoE backward: GEMM1 again needs an earlier replay (a run without a kept forward)");
  POUNCE_REQUIRE(which == BackwardGemm::kWeightDown || which == BackwardGemm::kWeightGateUp || buffers_->da.size() > 0,
                 "MoE backward: the data-gradient GEMMs alone need an earlier run of the chain's own data path");
  const int64_t E = config_.local_experts(), H = config_.hidden, I = config_.intermediate;
  allocate(dw_scratch_, E * 2 * I * H + E * H * I, "fp32 scratch", stream);
  gemm(which, dw_scratch_.data(), weight_grad_epilogue(output), stream);
}

void BackwardChain::run_weight_gradient_quantization(cudaStream_t stream) {
  POUNCE_REQUIRE(last_experts_.fp8_weight_gradients,
                 "MoE backward: the FP8 weight gradients' quantization alone needs an earlier run with them");
  quantize_transposed_rows(stream);
}

void BackwardChain::gemm(BackwardGemm which, void* weight_grad, gemm::Epilogue epilogue, cudaStream_t stream) {
  const int64_t E = config_.local_experts(), H = config_.hidden, I = config_.intermediate;
  const int32_t* offsets = rows_in_use_.expert_offsets;
  TimelineSink timeline = timeline_;
  timeline.kernel = uint8_t(timeline.kernel + int(which));
  // fp8 set: E4M3 operands (K-major weights) in place of a and b.
  const auto m_grouped = [&](const __nv_bfloat16* a, const __nv_bfloat16* b, gemm::Major b_major, int64_t n, int64_t k,
                             __nv_bfloat16* c, const gemm::Fp8Operands* fp8 = nullptr) {
    gemm::GroupedGemmArgs g;
    if (fp8 != nullptr) {
      g.fp8 = *fp8;
    } else {
      g.a = a;
      g.b = b;
      g.b_major = b_major;
    }
    g.a_rows = rows_;
    g.experts = int(E);
    g.n = n;
    g.k = k;
    g.c = c;
    g.expert_offsets = offsets;
    g.expert_rows = rows_in_use_.expert_rows;  // padding halves of tiles skip their MMAs
    g.timeline = timeline;
    gemm_.run(g, stream);
  };
  // FP8 weight gradients: the transposed E4M3 rows of the same buffers in place of a and b.
  const bool fp8_weights = last_experts_.fp8_weight_gradients;
  const auto k_grouped = [&](const __nv_bfloat16* a, const TransposedRows& a_t, int64_t m, const __nv_bfloat16* b,
                             const TransposedRows& b_t, int64_t n) {
    gemm::KGroupedGemmArgs g;
    if (fp8_weights) {
      g.fp8 = {a_t.q.data(), a_t.scales.data(), b_t.q.data(), b_t.scales.data()};
    } else {
      g.a = a;
      g.b = b;
    }
    g.rows = rows_;
    g.m = m;
    g.n = n;
    g.experts = int(E);
    g.expert_offsets = offsets;
    g.expert_rows = rows_in_use_.expert_rows;  // trailing all-padding K slices skipped
    g.c = weight_grad;
    g.epilogue = epilogue;
    g.timeline = timeline;
    gemm_.run_k_grouped(g, stream);
  };
  const Fp8TransposedWeights* fp8 = last_experts_.fp8;
  switch (which) {
    case BackwardGemm::kGateUp:
      return m_grouped(rows_in_use_.x_rows, last_experts_.w13, gemm::Major::kK, 2 * I, H, buffers_->h13.data());
    case BackwardGemm::kDataDown: {
      if (fp8 == nullptr)
        return m_grouped(route_rows_.dy, last_experts_.w2, gemm::Major::kMN, I, H, buffers_->da.data());
      const gemm::Fp8Operands operands = fp8->data_down(buffers_->dy_fp8.data(), buffers_->dy_scale.data());
      return m_grouped(nullptr, nullptr, gemm::Major::kK, I, H, buffers_->da.data(), &operands);
    }
    case BackwardGemm::kDataGateUp: {
      if (fp8 == nullptr)
        return m_grouped(route_rows_.dgu, last_experts_.w13, gemm::Major::kMN, H, 2 * I, buffers_->dx_rows.data());
      const gemm::Fp8Operands operands = fp8->data_gate_up(buffers_->dgu_fp8.data(), buffers_->dgu_scale.data());
      return m_grouped(nullptr, nullptr, gemm::Major::kK, H, 2 * I, buffers_->dx_rows.data(), &operands);
    }
    case BackwardGemm::kWeightDown:
      return k_grouped(route_rows_.dy, buffers_->dy_t, H, route_rows_.wa, buffers_->wa_t, I);
    case BackwardGemm::kWeightGateUp:
      return k_grouped(route_rows_.dgu, buffers_->dgu_t, 2 * I, rows_in_use_.x_rows, buffers_->x_t, H);
  }
}

void BackwardChain::check_device_errors() {
  // Both slots are read (and cleared) before either throws.
  std::string error;
  for (const auto& check : {std::function<void()>([&] { planner_.check_device_errors(); }),
                            std::function<void()>([&] { gemm_.check_device_errors(); })}) {
    try {
      check();
    } catch (const Error& e) {
      error += (error.empty() ? "" : "; and ") + std::string(e.what());
    }
  }
  if (!error.empty()) throw Error(error);
}

}  // namespace pounce::moe
