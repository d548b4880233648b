// Per-shape benchmark: the MoE forward through every implementation, then each grouped GEMM alone,
// all on the same weights, tokens and routing, in one process. Every timed output is checked against
// the reference chain's, on its first run and on its last timed run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <random>

#include "baseline/cublas_backward.h"
#include "baseline/cublas_moe.h"
#include "baseline/moe_kernels.h"
#include "baseline/pounce_unfused.h"
#include "bench/bench.h"
#include "bench/dense_ceiling.h"
#include "bench/device_fill.h"
#include "bench/output_check.h"
#include "common/gpu.h"
#include "common/require.h"
#include "common/tiles.h"
#include "common/timeline.h"
#include "formats/quantize_kernel.h"
#include "moe/backward/backward_chain.h"
#include "pounce/fused_moe.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {

namespace {

using baseline::Gemm;
using baseline::GemmCalls;
using Fp8Step = baseline::PounceUnfusedMoe::Fp8Step;

// What a row's speedup is measured against (compare()).
enum class Role {
  kBaseline,   // the cuBLAS chains: speedups are against the fastest of them
  kUnfused,    // pounce_unfused: a pounce row, and a baseline of the fused layer too
  kPounce,     // pounce's other rows: against the fastest baseline
  kFused,      // the fused layer: against the fastest of the baselines and pounce_unfused
  kReference,  // the dense GEMM and other yardsticks: no speedup
};

// A candidate's output and what it must match: got [rows, width] after the run of repetition `rep`
// against want(rep), rows whose row_token entry is negative (padding) skipped.
struct Output {
  const __nv_bfloat16* got = nullptr;  // null: nothing to check
  std::function<const __nv_bfloat16*(int rep)> want;
  int64_t rows = 0, width = 0;
  const int32_t* row_token = nullptr;
  std::string reference;           // what want is, for the JSON and the error message
  std::string row_name = "token";  // what a row is: the check's worst_<row_name>
  double max_relative_l2 = kMaxRelativeL2, max_worst_row = kMaxWorstToken;  // the check's limits
};

struct Candidate {
  std::string impl;
  Role role;
  std::function<void(int rep)> launch;
  Output output;
  double flops = 0;  // 0: the step's
};

// The larger error, NaN if either is.
double worse(double a, double b) { return std::isnan(a) || a > b ? a : b; }

// Checks one candidate's two checked runs against the tolerances: its JSON, and a loud message in
// `report` when it fails.
Json check_json(const std::string& shape, const std::string& what, const Candidate& c, const OutputError& first,
                const OutputError& last, Report& report) {
  const double l2 = worse(first.relative_l2, last.relative_l2), worst = worse(first.worst_row, last.worst_row);
  const double max_l2 = c.output.max_relative_l2, max_worst = c.output.max_worst_row;
  const bool ok = l2 <= max_l2 && worst <= max_worst;  // false for NaN
  if (!ok) {
    char message[512];
    std::snprintf(message, sizeof message,
                  "%s, %s, %s: relative L2 %.3g (limit %.0e), worst %s %.3g (limit %.0e) against %s "
                  "(first run %.3g / %.3g, last timed run %.3g / %.3g)",
                  shape.c_str(), what.c_str(), c.impl.c_str(), l2, max_l2, c.output.row_name.c_str(), worst, max_worst,
                  c.output.reference.c_str(), first.relative_l2, first.worst_row, last.relative_l2, last.worst_row);
    std::fflush(stdout);
    std::fprintf(stderr, "\n*** OUTPUT CHECK FAILED: %s\n\n", message);
    report.failures.push_back(message);
  }
  return {{"relative_l2", l2},
          {"worst_" + c.output.row_name, worst},
          {"ok", ok},
          {"reference", c.output.reference},
          {"limits", {{"relative_l2", max_l2}, {"worst_" + c.output.row_name, max_worst}}}};
}

// Times the candidates (interleaved) and checks each one's output on its first run and its last timed
// run; adds rows to the report and returns their JSON. Speedups: the fastest baseline's median over the
// row's (for the fused layer, the fastest of the baselines and pounce_unfused).
Json compare(const std::string& shape, const std::string& what, double flops, const std::vector<Candidate>& candidates,
             const Options& o, double dense_tflops, Report& report, cudaStream_t stream) {
  const size_t n = candidates.size();
  auto poison = [&](const Output& out) {
    // 0xFFFF is a NaN in bf16: whatever a run leaves unwritten fails the check. (Some outputs are a
    // chain's own buffers, read-only through its accessors.)
    CUDA_CHECK(cudaMemsetAsync(const_cast<__nv_bfloat16*>(out.got), 0xFF,
                               size_t(out.rows * out.width) * sizeof(__nv_bfloat16), stream));
  };
  // Allocated up front: a cudaMalloc among the timed launches would stall them.
  std::vector<std::optional<RowComparison>> first(n), last(n);
  for (size_t i = 0; i < n; ++i) {
    const Output& out = candidates[i].output;
    if (!out.got) continue;
    first[i].emplace(out.rows);
    last[i].emplace(out.rows);
    // One at a time: candidates may share an output buffer.
    poison(out);
    candidates[i].launch(0);
    first[i]->enqueue(out.got, out.want(0), out.width, out.row_token, stream);
  }

  std::vector<std::function<void(int)>> launches;
  for (const Candidate& c : candidates) launches.push_back(c.launch);
  const int last_rep = o.warmup + o.reps - 1;
  const std::vector<Timing> timings = time_interleaved(
      launches, stream, o.warmup, o.reps,
      [&](size_t c) {
        if (candidates[c].output.got) poison(candidates[c].output);
      },
      [&](size_t c) {
        const Output& out = candidates[c].output;
        if (out.got) last[c]->enqueue(out.got, out.want(last_rep), out.width, out.row_token, stream);
      });
  CUDA_CHECK(cudaStreamSynchronize(stream));

  double best_ms = INFINITY, unfused_ms = 0;
  std::string best_impl;
  for (size_t i = 0; i < n; ++i) {
    const double ms = timings[i].median_ms;
    if (candidates[i].role == Role::kBaseline && ms < best_ms) best_ms = ms, best_impl = candidates[i].impl;
    if (candidates[i].role == Role::kUnfused) unfused_ms = ms;
  }
  Json out = Json::array();
  for (size_t i = 0; i < n; ++i) {
    const Candidate& c = candidates[i];
    const Timing& t = timings[i];
    const double tflops = (c.flops > 0 ? c.flops : flops) / (t.median_ms * 1e-3) / 1e12;
    Row row{shape, what, c.impl, t.median_ms, tflops, tflops / dense_tflops, 0, 0, "-"};
    Json j = {{"what", what},
              {"impl", c.impl},
              {"timing", t},
              {"tflops", tflops},
              {"fraction_of_dense_bf16", tflops / dense_tflops}};
    double against = c.role == Role::kReference ? INFINITY : best_ms;
    std::string against_impl = best_impl;
    if (c.role == Role::kFused && unfused_ms > 0 && unfused_ms < against)
      against = unfused_ms, against_impl = "pounce_unfused";
    if (std::isfinite(against)) {
      row.speedup = against / t.median_ms;
      j["speedup_vs_best_baseline"] = row.speedup;
      j["best_baseline"] = against_impl;
    }
    if (c.role == Role::kFused && unfused_ms > 0) {
      row.vs_unfused = unfused_ms / t.median_ms;
      j["vs_pounce_unfused"] = row.vs_unfused;
    }
    if (c.output.got) {
      j["check"] = check_json(shape, what, c, first[i]->error(), last[i]->error(), report);
      row.check = j["check"]["ok"].get<bool>() ? "ok" : "FAILED";
    }
    report.table.push_back(row);
    out.push_back(std::move(j));
  }
  return out;
}

// The FP8 grouped GEMMs on the tokens and weights of the BF16 ones: the operands quantized as FP8
// training would (activations 1 x 128, weights 128 x 128, on the device), timed interleaved with pounce's
// BF16 GEMM and both dense ceilings. Each FP8 output is checked against pounce's BF16 GEMM on the same
// operands dequantized (exactly the values the FP8 GEMM multiplies); its distance from the BF16 chain's
// output (what quantization costs) is recorded beside it.
Json bench_fp8_gemms(const MoeModelShape& s, baseline::PounceUnfusedMoe& unfused, const __nv_bfloat16* w13,
                     const __nv_bfloat16* w2, const DeviceBuffer<__nv_bfloat16>& bf16_hidden,
                     const DeviceBuffer<__nv_bfloat16>& bf16_out, const Candidate& dense_bf16, const Options& o,
                     double dense_tflops, Report& report, cudaStream_t stream) {
  const int64_t H = s.hidden, I = s.intermediate, E = s.slice_experts;
  const baseline::RoutingPlan& plan = unfused.plan();
  const int64_t rows = plan.padded_rows;
  struct Quantized {
    DeviceBuffer<uint8_t> q;
    DeviceBuffer<float> scale;
    DeviceBuffer<__nv_bfloat16> exact;  // q dequantized
  };
  const auto quantize = [&](const __nv_bfloat16* x, int64_t r, int64_t c, bool weights) {
    Quantized out{DeviceBuffer<uint8_t>(r * c), DeviceBuffer<float>(weights ? r / 128 * (c / 128) : r * (c / 128)),
                  DeviceBuffer<__nv_bfloat16>(r * c)};
    const auto* bits = reinterpret_cast<const uint16_t*>(x);
    const formats::ScaleLayout layout{weights ? 0 : r};  // activations: K block-major, as the GEMM reads them
    if (weights)
      formats::quantize_128x128_device(bits, r, c, out.q.data(), out.scale.data(), stream);
    else
      formats::quantize_1x128_device(bits, r, c, out.q.data(), out.scale.data(), stream, layout);
    formats::dequantize_blockwise_device(out.q.data(), out.scale.data(), r, c, weights ? 128 : 1,
                                         reinterpret_cast<uint16_t*>(out.exact.data()), stream, layout);
    return out;
  };
  const Quantized x8 = quantize(unfused.pool(), rows, H, false), w13_8 = quantize(w13, E * 2 * I, H, true),
                  h8 = quantize(unfused.hidden(), rows, I, false), w2_8 = quantize(w2, E * H, I, true);

  gemm::GroupedGemm engine;
  const auto args = [&](const Quantized& a, const Quantized& b, bool gate_up, __nv_bfloat16* c, bool fp8) {
    gemm::GroupedGemmArgs g;
    g.a_rows = rows;
    g.experts = int(E);
    g.n = gate_up ? 2 * I : H;
    g.k = gate_up ? H : I;
    g.c = c;
    g.epilogue = gate_up ? gemm::Epilogue::kSwiGLU : gemm::Epilogue::kStore;
    g.expert_offsets = plan.expert_offsets_dev.data();
    g.expert_rows = plan.expert_routes_dev.data();
    if (fp8)
      g.fp8 = {a.q.data(), a.scale.data(), b.q.data(), b.scale.data()};
    else
      g.a = a.exact.data(), g.b = b.exact.data();
    return g;
  };
  DenseFp8Gemm dense_fp8(8192, true);
  const Candidate dense_fp8_reference{"cublasLt dense fp8 8192^3 (fast accumulation)",
                                      Role::kReference,
                                      [&](int) { dense_fp8.run(stream); },
                                      {},
                                      dense_fp8.flops()};
  Json gemms = Json::object();
  for (const bool gate_up : {true, false}) {
    const int64_t width = gate_up ? I : H;
    DeviceBuffer<__nv_bfloat16> want(rows * width), got(rows * width);
    const gemm::GroupedGemmArgs fp8_args =
        gate_up ? args(x8, w13_8, true, got.data(), true) : args(h8, w2_8, false, got.data(), true);
    engine.run(gate_up ? args(x8, w13_8, true, want.data(), false) : args(h8, w2_8, false, want.data(), false), stream);
    const Output output{got.data(),
                        [&want](int) -> const __nv_bfloat16* { return want.data(); },
                        rows,
                        width,
                        plan.row_token.data(),
                        "pounce bf16 GEMM on the dequantized FP8 operands",
                        "row"};
    const Output bf16_output{gate_up ? unfused.hidden() : unfused.expert_out(),
                             [&](int) -> const __nv_bfloat16* { return (gate_up ? bf16_hidden : bf16_out).data(); },
                             rows,
                             width,
                             plan.row_token.data(),
                             gate_up ? "cuBLAS chain's SwiGLU output" : "cuBLAS chain's GEMM2 output",
                             "row"};
    const Gemm which = gate_up ? Gemm::kGateUp : Gemm::kDown;
    const std::vector<Candidate> candidates = {
        {"pounce bf16", Role::kBaseline, [&, which](int) { unfused.run_gemm(which, stream); }, bf16_output},
        {"pounce fp8", Role::kPounce, [&](int) { engine.run(fp8_args, stream); }, output},
        dense_bf16,
        dense_fp8_reference};
    const double flops = (gate_up ? 4.0 : 2.0) * double(plan.routes) * double(H) * double(I);
    const char* what = gate_up ? "FP8 GEMM1 gate/up (SwiGLU)" : "FP8 GEMM2 down";
    Json rows_json = compare(s.name, what, flops, candidates, o, dense_tflops, report, stream);
    const double fp8_ceiling = rows_json.back()["tflops"].get<double>();
    for (Json& row : rows_json) row["fraction_of_dense_fp8"] = row["tflops"].get<double>() / fp8_ceiling;
    // What quantization costs: the FP8 output against the BF16 chain's.
    RowComparison quantization(rows);
    quantization.enqueue(got.data(), (gate_up ? bf16_hidden : bf16_out).data(), width, plan.row_token.data(), stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    engine.check_device_errors();
    const OutputError q = quantization.error();
    gemms[gate_up ? "gemm1_gate_up" : "gemm2_down"] = {
        {"rows", rows_json}, {"fp8_vs_bf16_chain", {{"relative_l2", q.relative_l2}, {"worst_row", q.worst_row}}}};
    std::printf("  %s: FP8 output vs the BF16 chain's: relative L2 %.3g, worst row %.3g\n", what, q.relative_l2,
                q.worst_row);
  }
  return gemms;
}

}  // namespace

Json bench_shape(const MoeModelShape& s, const Options& o, double dense_tflops, Report& report, cudaStream_t stream) {
  const int64_t T = s.slice_tokens, H = s.hidden, I = s.intermediate, E = s.slice_experts, k = s.topk;
  std::printf("\n%s: H %ld, I %ld, %ld local experts, %ld tokens, top-%ld, %s routing\n", s.name.c_str(), long(H),
              long(I), long(E), long(T), long(k), o.routing.c_str());
  std::fflush(stdout);
  std::mt19937_64 rng(42);  // benchmarks are reproducible; tests draw fresh inputs
  const auto ids = reference::synthetic_topk_ids(reference::parse_routing_pattern(o.routing), T, int(E), int(k), rng);
  const auto weights = reference::synthetic_topk_weights(T, int(k), rng);

  // Two token sets, rotated between repetitions; the weights (>= 100 MB) dwarf the L2 already.
  constexpr int kSets = 2;
  DeviceBuffer<__nv_bfloat16> w13(E * 2 * I * H), w2(E * H * I), y_cublas(T * H), y_pounce(T * H), y_fused(T * H);
  std::vector<DeviceBuffer<__nv_bfloat16>> x, y_ref;
  const float w_scale = 1.0f / std::sqrt(float(H));
  fill_random_bf16(w13.data(), w13.size(), 11, w_scale, stream);
  fill_random_bf16(w2.data(), w2.size(), 12, w_scale, stream);
  for (int i = 0; i < kSets; ++i) {
    x.emplace_back(T * H);
    fill_random_bf16(x.back().data(), T * H, 100 + i, 1.0f, stream);
    y_ref.emplace_back(T * H);
  }
  DeviceBuffer<float> d_weights(weights);

  const baseline::MoeDims dims{.max_tokens = T, .hidden = H, .intermediate = I, .experts = E, .topk = k};
  baseline::CublasMoe cublas(dims);
  cublas.set_weights(w13.data(), w2.data());
  cublas.set_routing(ids, T);
  baseline::PounceUnfusedMoe unfused(dims);
  unfused.set_weights(w13.data(), w2.data());
  unfused.set_routing(ids, T);
  const baseline::RoutingPlan& plan = cublas.plan();
  DeviceBuffer<int32_t> d_ids(ids);
  const EpConfig one_rank{
      .ranks = 1, .experts = int(E), .topk = int(k), .hidden = H, .intermediate = I, .max_tokens_per_rank = T};
  FusedMoe fused(one_rank);
  fused.set_weights({w13.data(), w2.data()});
  auto fused_forward = [&](FusedMoe& layer, int set, __nv_bfloat16* y) {
    const RankIO io{x[set].data(), d_ids.data(), d_weights.data(), T, y};
    layer.forward(std::span(&io, 1), stream);
  };

  Json result = {{"shape", s.name},
                 {"hidden", H},
                 {"intermediate", I},
                 {"model_experts", s.model_experts},
                 {"local_experts", E},
                 {"tokens", T},
                 {"topk", k},
                 {"routing", o.routing},
                 {"routes", plan.routes},
                 {"padded_rows", plan.padded_rows},
                 {"expert_routes", plan.expert_routes},
                 {"forward_flops", s.forward_flops()}};

  // The reference every forward is checked against: the cuBLAS grouped-batched chain (bf16 GEMMs, fp32
  // accumulation) on each token set. Set 0 last, so its intermediates are the chain's last.
  for (int i = kSets - 1; i >= 0; --i)
    cublas.forward(x[i].data(), d_weights.data(), y_ref[i].data(), GemmCalls::kGroupedBatched, stream);
  auto forward_output = [&](const __nv_bfloat16* y) {
    return Output{y,       [&](int rep) -> const __nv_bfloat16* { return y_ref[rep % kSets].data(); },
                  T,       H,
                  nullptr, "cublas_grouped_batched y"};
  };
  // The relative L2 differences of the summaries: the hidden activations here, y from the checks below.
  unfused.forward(x[0].data(), d_weights.data(), y_pounce.data(), stream);
  RowComparison hidden(plan.padded_rows);
  hidden.enqueue(unfused.hidden(), cublas.hidden(), I, plan.row_token.data(), stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  unfused.check_device_errors();
  result["relative_l2_difference"]["hidden_pounce_vs_cublas"] = hidden.error().relative_l2;

  // The dense ceiling timed interleaved with every comparison: same clocks, same temperature (under
  // sustained load the H200 runs at its power cap and lowers its clocks).
  DenseBf16Gemm dense(8192);
  const Candidate dense_reference{
      "cublas dense 8192^3", Role::kReference, [&](int) { dense.run(stream); }, {}, dense.flops()};
  const Candidate unfused_forward{
      "pounce_unfused", Role::kUnfused,
      [&](int rep) { unfused.forward(x[rep % kSets].data(), d_weights.data(), y_pounce.data(), stream); },
      forward_output(y_pounce.data())};

  std::vector<Candidate> forward;
  for (GemmCalls calls : {GemmCalls::kLoop, GemmCalls::kGroupedBatched})
    forward.push_back({baseline::gemm_calls_name(calls), Role::kBaseline,
                       [&, calls](int rep) {
                         cublas.forward(x[rep % kSets].data(), d_weights.data(), y_cublas.data(), calls, stream);
                       },
                       forward_output(y_cublas.data())});
  forward.push_back(unfused_forward);
  // The chain as the fused layer runs it: routing in device memory, scheduled on the GPU every forward.
  forward.push_back({"pounce_unfused, device schedule", Role::kPounce,
                     [&](int rep) {
                       unfused.forward_with_device_schedule(x[rep % kSets].data(), d_ids.data(), T, d_weights.data(),
                                                            y_pounce.data(), stream);
                     },
                     forward_output(y_pounce.data())});
  // The unfused chain's two GEMMs alone, on the rows its last forward permuted: what the chain's other
  // steps (permute, combine, planning) add, under the same clocks. A yardstick, not an implementation
  // of the forward: no speedup, and no check here (which forward's rows it reads varies; the GEMMs
  // are checked in the GEMM comparisons).
  forward.push_back({"pounce GEMM1 + GEMM2 alone",
                     Role::kReference,
                     [&](int) {
                       unfused.run_gemm(Gemm::kGateUp, stream);
                       unfused.run_gemm(Gemm::kDown, stream);
                     },
                     {}});
  // The unfused chain in FP8 (E4M3, blockwise scales; weights quantized once, outside the timing), against
  // the BF16 chain's output within the FP8 band.
  // The fused layer's E4M3 forward likewise (tokens and hidden rows quantized inside its kernel).
  const bool fp8_shape = H % 128 == 0 && I % 128 == 0;
  DeviceBuffer<__nv_bfloat16> y_fp8(fp8_shape ? T * H : 0), y_fused_fp8(y_fp8.size());
  const auto fp8_output = [&](const __nv_bfloat16* y) {
    Output output = forward_output(y);
    output.max_relative_l2 = kFp8MaxRelativeL2;
    output.max_worst_row = kFp8MaxWorstToken;
    return output;
  };
  const Candidate unfused_fp8_forward{
      "pounce_unfused fp8", Role::kPounce,
      [&](int rep) { unfused.forward_fp8(x[rep % kSets].data(), d_weights.data(), y_fp8.data(), stream); },
      fp8_output(y_fp8.data())};
  std::optional<FusedMoe> fused_fp8;
  if (fp8_shape) {
    unfused.quantize_weights_fp8(stream);
    forward.push_back(unfused_fp8_forward);
    FusedMoeOptions fp8_options;
    fp8_options.fp8_forward = true;
    fused_fp8.emplace(one_rank, fp8_options);
    fused_fp8->set_weights({w13.data(), w2.data()});
    fused_fp8->refresh_fp8_weights(stream);
    forward.push_back({"pounce_fused fp8", Role::kPounce,
                       [&](int rep) { fused_forward(*fused_fp8, rep % kSets, y_fused_fp8.data()); },
                       fp8_output(y_fused_fp8.data())});
  }
  forward.push_back({"pounce_fused", Role::kFused, [&](int rep) { fused_forward(fused, rep % kSets, y_fused.data()); },
                     forward_output(y_fused.data())});
  forward.push_back(dense_reference);
  result["forward"] = compare(s.name, "forward", s.forward_flops(), forward, o, dense_tflops, report, stream);
  double unfused_ms = 0, fp8_ms = 0, fused_ms = 0, fused_fp8_ms = 0;
  for (const Json& row : result["forward"]) {
    const std::string impl = row["impl"];
    if (impl == "pounce_unfused" || impl == "pounce_fused" || impl == "pounce_unfused fp8" ||
        impl == "pounce_fused fp8")
      result["relative_l2_difference"]["y_" + impl + "_vs_cublas"] = row["check"]["relative_l2"];
    const double ms = row["timing"].at("median_ms").get<double>();
    if (impl == "pounce_unfused") unfused_ms = ms;
    if (impl == "pounce_unfused fp8") fp8_ms = ms;
    if (impl == "pounce_fused") fused_ms = ms;
    if (impl == "pounce_fused fp8") fused_fp8_ms = ms;
  }
  if (fused_fp8_ms > 0) {
    result["fused_fp8"] = {{"fused_bf16_over_fp8", fused_ms / fused_fp8_ms},
                           {"unfused_fp8_over_fused_fp8", fp8_ms / fused_fp8_ms}};
    std::printf("  fused FP8 forward: %.3f ms against %.3f fused BF16 (%.2fx) and %.3f unfused FP8 (%.2fx)\n",
                fused_fp8_ms, fused_ms, fused_ms / fused_fp8_ms, fp8_ms, fp8_ms / fused_fp8_ms);
  }
  if (fp8_ms > 0) {
    // What the FP8 chain's quantization passes cost (interleaved): gathering and quantizing the tokens in
    // place of the BF16 chain's permute, and quantizing the hidden rows, a pass of its own.
    DeviceBuffer<__nv_bfloat16> permuted(plan.padded_rows * H);
    const std::vector<std::function<void(int)>> passes = {
        [&](int rep) {
          baseline::permute_rows(x[rep % kSets].data(), plan.row_token.data(), plan.padded_rows, H, permuted.data(),
                                 stream);
        },
        [&](int rep) { unfused.run_fp8_step(Fp8Step::kQuantizeTokens, x[rep % kSets].data(), stream); },
        [&](int) { unfused.run_fp8_step(Fp8Step::kQuantizeHidden, nullptr, stream); }};
    const std::vector<Timing> t = time_interleaved(passes, stream, o.warmup, o.reps);
    result["fp8_chain"] = {{"unfused_bf16_over_fp8", unfused_ms / fp8_ms},
                           {"permute_bf16", t[0]},
                           {"gather_quantize_tokens", t[1]},
                           {"quantize_hidden", t[2]}};
    std::printf(
        "  FP8 chain: %.3f ms against %.3f BF16 (%.2fx); token permute %.3f ms bf16, %.3f gathered and "
        "quantized; hidden quantized %.3f\n",
        fp8_ms, unfused_ms, unfused_ms / fp8_ms, t[0].median_ms, t[1].median_ms, t[2].median_ms);
  }
  result["fused_config"] = {{"comm_ctas", fused.comm_ctas()},
                            {"engine_rows", fused.engine_rows()},
                            {"ctas_per_rank", fused.ctas_per_rank()},
                            {"minibatch_rows", fused.minibatch_rows()},
                            {"ring_blocks", fused.ring_blocks()}};

  if (o.sweeps) {
    // Each setting is its own layer on the same inputs, timed interleaved with the others and the default.
    // E4M3 settings (fp8_forward) are compared with the unfused E4M3 chain, the others with the BF16 one.
    auto sweep = [&](const std::string& what, const std::vector<std::pair<std::string, FusedMoeOptions>>& settings,
                     int ranks = 1) {
      const bool fp8 = settings.front().second.fp8_forward;
      for (const auto& [name, options] : settings)
        POUNCE_REQUIRE(options.fp8_forward == fp8, "sweep '", what, "': setting '", name,
                       "' mixes the E4M3 and BF16 forwards, which have different baselines");
      std::vector<std::unique_ptr<FusedMoe>> layers;
      std::vector<Candidate> candidates;
      for (const auto& [name, options] : settings) {
        EpConfig config = one_rank;
        config.ranks = ranks;
        config.max_tokens_per_rank = (T + ranks - 1) / ranks;
        layers.push_back(std::make_unique<FusedMoe>(config, options));
        // Rank r is given its own experts only: [r E/P, (r+1) E/P) of the shape's weights.
        std::vector<ExpertWeights> local(ranks);
        for (int r = 0; r < ranks; ++r)
          local[r] = {w13.data() + r * (E / ranks) * 2 * I * H, w2.data() + r * (E / ranks) * H * I};
        layers.back()->set_weights(local);
        if (options.fp8_forward) layers.back()->refresh_fp8_weights(stream);
        FusedMoe* layer = layers.back().get();
        candidates.push_back({name, Role::kFused,
                              [&, layer, ranks](int rep) {
                                // Rank r holds tokens [r T/P, (r+1) T/P) of the same batch.
                                std::vector<RankIO> io(ranks);
                                const int64_t per_rank = (T + ranks - 1) / ranks;
                                for (int r = 0; r < ranks; ++r) {
                                  const int64_t first = std::min(T, r * per_rank), n = std::min(T - first, per_rank);
                                  io[r] = {x[rep % kSets].data() + first * H, d_ids.data() + first * k,
                                           d_weights.data() + first * k, n, y_fused.data() + first * H};
                                }
                                layer->forward(io, stream);
                              },
                              fp8 ? fp8_output(y_fused.data()) : forward_output(y_fused.data())});
      }
      candidates.push_back(fp8 ? unfused_fp8_forward : unfused_forward);
      candidates.push_back(dense_reference);
      Json j = Json::object();
      j["timings"] = compare(s.name, what, s.forward_flops(), candidates, o, dense_tflops, report, stream);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      Json configs = Json::array();
      for (size_t i = 0; i < layers.size(); ++i) {
        layers[i]->check_device_errors();
        configs.push_back({{"impl", settings[i].first},
                           {"minibatch_rows", layers[i]->minibatch_rows()},
                           {"comm_ctas", layers[i]->comm_ctas()},
                           {"engine_rows", layers[i]->engine_rows()},
                           {"ring_blocks", layers[i]->ring_blocks()},
                           {"ctas_per_rank", layers[i]->ctas_per_rank()}});
      }
      j["layers"] = configs;
      return j;
    };
    Json sweeps = Json::object();
    std::vector<std::pair<std::string, FusedMoeOptions>> settings;
    // Communication CTAs at every shape: how many a layer needs depends on its bytes moved per FLOP.
    for (int comm : {2, 4, 6, 8, 10, 12, 16, 24, 32, 40}) {
      FusedMoeOptions m;
      m.comm_ctas = comm;
      settings.push_back({"comm CTAs " + std::to_string(comm), m});
    }
    sweeps["comm_ctas"] = sweep("fused: comm CTAs", settings);
    settings.clear();
    // Minibatches at every shape: the default follows GEMM1's width (two waves of its tiles).
    for (int blocks : {2, 4, 8, 16, 32, 64}) {
      FusedMoeOptions m;
      m.minibatch_rows = int64_t(blocks) * kBlockM;
      settings.push_back({"minibatch " + std::to_string(blocks) + " m-blocks", m});
    }
    sweeps["minibatch"] = sweep("fused: minibatch", settings);
    settings.clear();
    if (s.name == default_shape().name) {
      for (int rows : {0, 32, 48, 64, 96, 128}) {
        FusedMoeOptions m;
        m.engine_rows = rows;
        settings.push_back({"engine rows " + std::to_string(rows), m});
      }
      sweeps["engine_rows"] = sweep("fused: engine rows", settings);
      settings.clear();
      // Bounded rings of 2 (the minimum) to 12 minibatches with the default layer's minibatch and comm
      // CTAs, rows combined through slots reused all forward, against the default (at one rank: in place,
      // nothing combined): what a ring budget costs.
      settings.push_back({std::string("ring default, ") + std::to_string(fused.ring_blocks()) + " m-blocks", {}});
      const int64_t bpm = (fused.minibatch_rows() + kBlockM - 1) / kBlockM;
      for (int minibatches : {2, 3, 4, 6, 8, 12}) {
        FusedMoeOptions bounded;
        bounded.minibatch_rows = fused.minibatch_rows();
        bounded.comm_ctas = fused.comm_ctas();
        bounded.ring_blocks = minibatches * bpm;
        settings.push_back({"ring " + std::to_string(minibatches) + " minibatches, " +
                                std::to_string(bounded.ring_blocks) + " m-blocks",
                            bounded});
      }
      sweeps["ring"] = sweep("fused: ring", settings);
      settings.clear();
      Json ranks = Json::object();
      for (const char* P : {"1", "2", "4", "8"})
        ranks[std::string("P") + P] = sweep("fused: virtual ranks", {{std::string("P=") + P, {}}}, std::atoi(P));
      sweeps["virtual_ranks"] = ranks;
    }
    result["fused_sweeps"] = sweeps;
    if (fp8_shape) {
      // The E4M3 forward moves rows of H bytes and runs tiles half as wide as the BF16 ones: its own
      // communication CTAs and minibatch, against the unfused E4M3 chain.
      Json fp8_sweeps = Json::object();
      const auto fp8_setting = [](int comm_ctas, int64_t minibatch_rows) {
        FusedMoeOptions m;
        m.fp8_forward = true;
        m.comm_ctas = comm_ctas;
        m.minibatch_rows = minibatch_rows;
        return m;
      };
      settings.push_back({"E4M3 default", fp8_setting(0, 0)});
      for (int comm : {4, 8, 16, 24, 32})
        settings.push_back({"E4M3 comm CTAs " + std::to_string(comm), fp8_setting(comm, 0)});
      fp8_sweeps["comm_ctas"] = sweep("fused E4M3: comm CTAs", settings);
      settings.clear();
      const int64_t bpm = (fused_fp8->minibatch_rows() + kBlockM - 1) / kBlockM;
      settings.push_back({"E4M3 default, " + std::to_string(bpm) + " m-blocks", fp8_setting(0, 0)});
      for (int64_t blocks : {bpm / 2, 2 * bpm, 4 * bpm})
        if (blocks > 0)
          settings.push_back(
              {"E4M3 minibatch " + std::to_string(blocks) + " m-blocks", fp8_setting(0, blocks * kBlockM)});
      fp8_sweeps["minibatch"] = sweep("fused E4M3: minibatch", settings);
      settings.clear();
      result["fused_fp8_sweeps"] = fp8_sweeps;
    }
  }

  if (o.gemms) {
    // Each GEMM's references: what the reference chain's GEMMs wrote for token set 0, kept aside. The
    // GEMMs run on what the two chains' forwards on set 0 leave (permuted tokens, hidden activations), in
    // one layout: both plan on the host from the same routing. Padding rows are not compared.
    const int64_t rows = plan.padded_rows;
    cublas.forward(x[0].data(), d_weights.data(), y_cublas.data(), GemmCalls::kGroupedBatched, stream);
    unfused.forward(x[0].data(), d_weights.data(), y_pounce.data(), stream);
    DeviceBuffer<__nv_bfloat16> ref_gate_up(rows * 2 * I), ref_hidden(rows * I), ref_out(rows * H);
    for (const auto& [to, from] : {std::pair(&ref_gate_up, cublas.gate_up()), std::pair(&ref_hidden, cublas.hidden()),
                                   std::pair(&ref_out, cublas.expert_out())})
      CUDA_CHECK(cudaMemcpyAsync(to->data(), from, to->bytes(), cudaMemcpyDeviceToDevice, stream));
    auto gemm_output = [&](const __nv_bfloat16* got, const DeviceBuffer<__nv_bfloat16>& want, int64_t width,
                           const char* reference) {
      return Output{got,
                    [&want](int) -> const __nv_bfloat16* { return want.data(); },
                    rows,
                    width,
                    plan.row_token.data(),
                    reference,
                    "row"};
    };
    const double routes = double(plan.routes);
    Json gemms = Json::object();
    for (Gemm which : {Gemm::kGateUp, Gemm::kDown}) {
      const bool gate_up = which == Gemm::kGateUp;
      // cuBLAS's GEMM1 writes gate/up before SwiGLU, pounce's the SwiGLU output; pounce's GEMM2 reads
      // pounce's GEMM1 output, so it is checked against the cuBLAS chain's GEMM2 output like cuBLAS's own.
      const Output cublas_output = gate_up
                                       ? gemm_output(cublas.gate_up(), ref_gate_up, 2 * I, "cuBLAS chain's gate/up")
                                       : gemm_output(cublas.expert_out(), ref_out, H, "cuBLAS chain's GEMM2 output");
      const Output pounce_output = gate_up
                                       ? gemm_output(unfused.hidden(), ref_hidden, I, "cuBLAS chain's SwiGLU output")
                                       : gemm_output(unfused.expert_out(), ref_out, H, "cuBLAS chain's GEMM2 output");
      std::vector<Candidate> candidates;
      for (GemmCalls calls : {GemmCalls::kLoop, GemmCalls::kGroupedBatched})
        candidates.push_back({baseline::gemm_calls_name(calls), Role::kBaseline,
                              [&, calls, which](int) { cublas.run_gemm(which, calls, stream); }, cublas_output});
      candidates.push_back({gate_up ? "pounce (SwiGLU fused)" : "pounce", Role::kPounce,
                            [&, which](int) { unfused.run_gemm(which, stream, gemm::GemmTuning{}); }, pounce_output});
      // Tuning sweep, recorded so the default stays justified by measurement.
      for (int band : {8, 32})
        candidates.push_back(
            {"pounce, band " + std::to_string(band), Role::kPounce,
             [&, which, band](int) { unfused.run_gemm(which, stream, gemm::GemmTuning{.band_m_blocks = band}); },
             pounce_output});
      candidates.push_back(dense_reference);
      const double flops = gate_up ? 2.0 * routes * 2 * I * H : 2.0 * routes * H * I;
      gemms[gate_up ? "gemm1_gate_up" : "gemm2_down"] =
          compare(s.name, gate_up ? "GEMM1 gate/up" : "GEMM2 down", flops, candidates, o, dense_tflops, report, stream);
    }
    result["grouped_gemms"] = gemms;
    result["grouped_gemms_fp8"] = bench_fp8_gemms(s, unfused, w13.data(), w2.data(), ref_hidden, ref_out,
                                                  dense_reference, o, dense_tflops, report, stream);
  }

  if (o.backward) {
    // The backward on one GPU (FLOPs: 12 routes H I; a replay's GEMM1 is not counted), three ways:
    //   kept:   the layer's backward after a training forward, from the rows that forward kept (its
    //           schedule, its ring's x rows, the gate/up rows its GEMM1 stored): no GEMM1; its data path
    //           the chain of kernels (the default) or one persistent kernel (fused_backward);
    //   replay: pounce's backward chain alone, planning again and recomputing GEMM1 from x;
    // then forward + backward both ways. dx is checked against the replay's first run on the same
    // token set (the test suite checks both against the host reference).
    moe::BackwardChain chain(one_rank);
    std::vector<DeviceBuffer<__nv_bfloat16>> dy, dx_first;
    for (int i = 0; i < kSets; ++i) {
      dy.emplace_back(T * H);
      fill_random_bf16(dy.back().data(), T * H, 200 + i, 1.0f, stream);
      dx_first.emplace_back(T * H);
    }
    DeviceBuffer<__nv_bfloat16> dx(T * H);
    DeviceBuffer<float> d_topk(T * k), dw13(E * 2 * I * H), dw2(E * H * I);
    const auto replay = [&](int set, __nv_bfloat16* into) {
      chain.run({x[set].data(), d_ids.data(), d_weights.data(), T, dy[set].data(), into, d_topk.data()},
                {w13.data(), w2.data(), dw13.data(), dw2.data(), WeightGradOutput::kF32}, nullptr, stream);
    };
    for (int i = 0; i < kSets; ++i) replay(i, dx_first[i].data());
    // The replay with its two data gradients in FP8 (weights transposed and quantized once, outside the
    // timing, as once per weight update), on a chain of its own so that its GEMMs can be timed alone too.
    std::optional<moe::BackwardChain> chain_fp8;
    std::optional<moe::Fp8TransposedWeights> w_fp8;
    if (fp8_shape) {
      chain_fp8.emplace(one_rank);
      w_fp8.emplace(E, H, I);
      w_fp8->refresh(w13.data(), w2.data(), stream);
    }
    DeviceBuffer<__nv_bfloat16> dx_fp8(fp8_shape ? T * H : 0);
    // fp8_weights: the weight gradients in FP8 too.
    const auto replay_fp8 = [&](int set, bool fp8_weights) {
      chain_fp8->run({x[set].data(), d_ids.data(), d_weights.data(), T, dy[set].data(), dx_fp8.data(), d_topk.data()},
                     {w13.data(), w2.data(), dw13.data(), dw2.data(), WeightGradOutput::kF32, &*w_fp8, fp8_weights},
                     nullptr, stream);
    };
    int kept_replays = 0;  // backwards meant to start from a kept forward that replayed instead
    DeviceBuffer<__nv_bfloat16> dw13_bf16(E * 2 * I * H), dw2_bf16(E * H * I);
    const auto layer_backward = [&](int set, bool from_kept, WeightGradOutput mode = WeightGradOutput::kF32) {
      const RankIO io{x[set].data(), d_ids.data(), d_weights.data(), T, nullptr};
      const bool bf16 = mode == WeightGradOutput::kBf16;
      fused.backward(
          io,
          {dy[set].data(), dx.data(), d_topk.data(), bf16 ? static_cast<void*>(dw13_bf16.data()) : dw13.data(),
           bf16 ? static_cast<void*>(dw2_bf16.data()) : dw2.data()},
          mode, stream);
      kept_replays += from_kept && fused.last_backward_replayed();
    };
    const auto training_forward = [&](int set) {
      const RankIO io{x[set].data(), d_ids.data(), d_weights.data(), T, y_fused.data()};  // y checked as forward's
      fused.forward(io, stream, /*keep_for_backward=*/true);
    };
    // The kept backward is timed on set 0 alone: what a forward keeps is valid until the next forward.
    training_forward(0);
    // A layer of its own whose backward is the persistent kernel (`comm_ctas`, `minibatch_rows`: 0 for the
    // defaults), with its training forward on set 0 kept (keep_forward); and that backward.
    const auto fused_backward_layer_with = [&](int comm_ctas, int64_t minibatch_rows = 0) {
      return std::make_unique<FusedMoe>(
          one_rank, FusedMoeOptions{.comm_ctas = comm_ctas, .minibatch_rows = minibatch_rows, .fused_backward = true});
    };
    const auto keep_forward = [&](std::unique_ptr<FusedMoe> layer) {
      layer->set_weights({w13.data(), w2.data()});
      layer->forward({x[0].data(), d_ids.data(), d_weights.data(), T, y_fused.data()}, stream,
                     /*keep_for_backward=*/true);
      return layer;
    };
    const auto kept_fused_backward_layer = [&](int comm_ctas) {
      return keep_forward(fused_backward_layer_with(comm_ctas));
    };
    const auto fused_backward = [&](FusedMoe& layer) {
      layer.backward({x[0].data(), d_ids.data(), d_weights.data(), T, nullptr},
                     {dy[0].data(), dx.data(), d_topk.data(), dw13.data(), dw2.data()}, WeightGradOutput::kF32, stream);
      kept_replays += layer.last_backward_replayed();
    };
    const std::unique_ptr<FusedMoe> fused_backward_layer = kept_fused_backward_layer(0);
    // keep_x_rows = false: the forward's x ring shared by the layers of the shape, the backward copying
    // the x rows again (its X items).
    const std::unique_ptr<FusedMoe> copying_x_layer = keep_forward(
        std::make_unique<FusedMoe>(one_rank, FusedMoeOptions{.fused_backward = true, .keep_x_rows = false}));
    const auto own_bytes = [](const FusedMoe& layer) { return layer.device_bytes() - layer.shared_device_bytes(); };
    const double routes = double(plan.routes), backward_flops = 12.0 * routes * double(H) * double(I);
    const auto dx_check = [&](const char* reference) {
      return Output{dx.data(), [&](int rep) { return dx_first[rep % kSets].data(); }, T, H, nullptr, reference};
    };
    const Output dx_set0{dx.data(), [&](int) { return dx_first[0].data(); }, T, H, nullptr, "the replay's first run"};
    const Candidate chain_from_kept{"pounce backward, from the kept forward", Role::kUnfused,
                                    [&](int) { layer_backward(0, true); }, dx_set0};
    std::vector<Candidate> backward_candidates = {
        {"pounce backward, replay (plans, recomputes GEMM1)", Role::kUnfused,
         [&](int rep) { replay(rep % kSets, dx.data()); }, dx_check("the replay's own first run")},
        chain_from_kept,
        {"pounce backward, from the kept forward, fused kernel", Role::kFused,
         [&](int) { fused_backward(*fused_backward_layer); }, dx_set0},
        {"pounce backward, from the kept forward, fused kernel, x rows copied again", Role::kFused,
         [&](int) { fused_backward(*copying_x_layer); }, dx_set0},
        {"pounce backward, from the kept forward, bf16 weight gradients", Role::kFused,
         [&](int) { layer_backward(0, true, WeightGradOutput::kBf16); }, dx_set0}};
    if (fp8_shape) {
      // dx against the bf16 replay's within the FP8 band.
      Output dx_fp8_check{dx_fp8.data(),
                          [&](int rep) { return dx_first[rep % kSets].data(); },
                          T,
                          H,
                          nullptr,
                          "the bf16 replay's first run"};
      dx_fp8_check.max_relative_l2 = kFp8MaxRelativeL2;
      dx_fp8_check.max_worst_row = kFp8MaxWorstToken;
      backward_candidates.push_back({"pounce backward, replay, FP8 data gradients", Role::kPounce,
                                     [&](int rep) { replay_fp8(rep % kSets, false); }, dx_fp8_check});
      backward_candidates.push_back({"pounce backward, replay, FP8 data and weight gradients", Role::kPounce,
                                     [&](int rep) { replay_fp8(rep % kSets, true); }, dx_fp8_check});
    }
    backward_candidates.push_back(dense_reference);
    result["backward"] =
        compare(s.name, "backward", backward_flops, backward_candidates, o, dense_tflops, report, stream);
    if (o.sweeps) {
      // The fused backward's communication CTAs (dy rows pulled, dx rows summed), each count its own
      // layer with its own kept forward on set 0, timed interleaved with the chain from `fused`'s kept
      // forward (still set 0's: no forward of `fused` runs in between) and the dense GEMM.
      std::vector<std::unique_ptr<FusedMoe>> layers;
      std::vector<Candidate> candidates;
      for (int comm : {0, 4, 8, 12, 16, 24, 32, 48}) {
        layers.push_back(kept_fused_backward_layer(comm));
        FusedMoe* layer = layers.back().get();
        candidates.push_back(
            {"fused backward, comm CTAs " +
                 (comm == 0 ? "default (" + std::to_string(layer->comm_ctas()) + ")" : std::to_string(comm)),
             Role::kFused, [&, layer](int) { fused_backward(*layer); }, dx_set0});
      }
      candidates.push_back(chain_from_kept);
      candidates.push_back(dense_reference);
      result["fused_backward_sweeps"] = {{"comm_ctas",
                                          {{"timings", compare(s.name, "fused backward: comm CTAs", backward_flops,
                                                               candidates, o, dense_tflops, report, stream)}}}};
      const auto check_and_free = [&] {
        CUDA_CHECK(cudaStreamSynchronize(stream));
        for (const auto& layer : layers) layer->check_device_errors();
        layers.clear();
        candidates.clear();
      };
      check_and_free();
      // Its minibatch (the queue's steps of D1, S and D2 work, and the m-blocks whose tiles share weight
      // columns in L2), the same way: each size the layer resolves once (it runs at least 16 m-blocks).
      std::vector<int64_t> swept_rows;
      for (int64_t blocks : {int64_t(0), int64_t(16), int64_t(32), int64_t(64)}) {
        auto layer = fused_backward_layer_with(0, blocks * kBlockM);
        const int64_t rows = layer->backward_minibatch_rows();
        if (std::find(swept_rows.begin(), swept_rows.end(), rows) != swept_rows.end()) continue;
        swept_rows.push_back(rows);
        layers.push_back(keep_forward(std::move(layer)));
        FusedMoe* kept = layers.back().get();
        candidates.push_back({"fused backward, minibatch " + std::to_string(rows / kBlockM) + " m-blocks" +
                                  (blocks == 0 ? " (default)" : ""),
                              Role::kFused, [&, kept](int) { fused_backward(*kept); }, dx_set0});
      }
      candidates.push_back(chain_from_kept);
      candidates.push_back(dense_reference);
      result["fused_backward_sweeps"]["minibatch"] = {
          {"timings",
           compare(s.name, "fused backward: minibatch", backward_flops, candidates, o, dense_tflops, report, stream)}};
      check_and_free();
    }
    const double forward_flops = 6.0 * routes * double(H) * double(I);
    // What keeping costs the forward: GEMM1's epilogue stores 2I more columns per row.
    result["training_forward"] =
        compare(s.name, "forward, training", forward_flops,
                {{"pounce fused forward", Role::kUnfused,
                  [&](int rep) { fused_forward(fused, rep % kSets, y_fused.data()); }, forward_output(y_fused.data())},
                 {"pounce fused training forward (keeps gate/up)", Role::kFused,
                  [&](int rep) { training_forward(rep % kSets); }, forward_output(y_fused.data())},
                 dense_reference},
                o, dense_tflops, report, stream);
    result["forward_backward"] = compare(s.name, "forward + backward", forward_flops + backward_flops,
                                         {{"pounce fused forward + backward replay", Role::kUnfused,
                                           [&](int rep) {
                                             fused_forward(fused, rep % kSets, y_fused.data());
                                             layer_backward(rep % kSets, false);
                                           },
                                           dx_check("the replay chain's first run")},
                                          {"pounce fused training forward + backward from it", Role::kFused,
                                           [&](int rep) {
                                             training_forward(rep % kSets);
                                             layer_backward(rep % kSets, true);
                                           },
                                           dx_check("the replay chain's first run")},
                                          dense_reference},
                                         o, dense_tflops, report, stream);
    if (kept_replays > 0)
      report.failures.push_back(s.name + ": " + std::to_string(kept_replays) +
                                " backwards of a kept forward replayed it instead (the forward was not the latest)");
    // Memory either way beyond the forward's own buffers: the kept gate/up rows, or the replay's x and
    // gate/up rows (both hold the backward's other buffers alike).
    const int64_t capacity = chain.capacity_rows();
    result["backward_memory"] = {{"capacity_rows", capacity},
                                 {"kept_bytes", capacity * 2 * I * 2},
                                 {"replay_bytes", capacity * (H + 2 * I) * 2},
                                 {"kept_bytes_per_token", double(capacity * 2 * I * 2) / double(T)},
                                 {"layer_device_bytes", fused.device_bytes()},
                                 // Each layer's own memory (its shared rows left out) with the fused backward,
                                 // keeping its x rows and not (FusedMoeOptions::keep_x_rows).
                                 {"layer_own_bytes", own_bytes(*fused_backward_layer)},
                                 {"layer_own_bytes_without_kept_x_rows", own_bytes(*copying_x_layer)}};
    // Each GEMM of the backward alone (on the chain's buffers of its last replay), beside one cuBLAS call
    // per expert on the same schedule and the dense GEMM.
    baseline::CublasBackwardGemms cublas_backward(dims, plan, w13.data(), w2.data(), stream);
    Json gemms = Json::object();
    const std::tuple<const char*, const char*, moe::BackwardGemm> kinds[] = {
        {"gemm1_again", "GEMM1 again (gate/up)", moe::BackwardGemm::kGateUp},
        {"dgrad_down", "dgrad down (dy W2)", moe::BackwardGemm::kDataDown},
        {"dgrad_gate_up", "dgrad gate/up (dgu W13)", moe::BackwardGemm::kDataGateUp},
        {"wgrad_down", "wgrad down (dW2)", moe::BackwardGemm::kWeightDown},
        {"wgrad_gate_up", "wgrad gate/up (dW13)", moe::BackwardGemm::kWeightGateUp}};
    if (fp8_shape) replay_fp8(0, true);  // its GEMMs alone below: all four in FP8
    for (const auto& [key, name, which] : kinds) {
      const bool gate_up = which == moe::BackwardGemm::kGateUp || which == moe::BackwardGemm::kDataGateUp ||
                           which == moe::BackwardGemm::kWeightGateUp;
      std::vector<Candidate> candidates;
      if (which != moe::BackwardGemm::kGateUp)
        candidates.push_back({"cublas_loop",
                              Role::kBaseline,
                              [&cublas_backward, which = which, stream](int) { cublas_backward.run(which, stream); },
                              {}});
      candidates.push_back(
          {"pounce", Role::kPounce, [&chain, which = which, stream](int) { chain.run_gemm(which, stream); }, {}});
      if (which == moe::BackwardGemm::kWeightDown || which == moe::BackwardGemm::kWeightGateUp) {
        // The other two outputs a training step asks for: bf16 gradients (half the epilogue's bytes) and
        // accumulation into fp32 main gradients (a read of each output beside the write).
        for (const auto& [impl, output] : {std::pair{"pounce bf16 out", WeightGradOutput::kBf16},
                                           std::pair{"pounce fp32 accumulated", WeightGradOutput::kAccumulateF32}})
          candidates.push_back(
              {impl,
               Role::kPounce,
               [&chain, which = which, output = output, stream](int) { chain.run_gemm(which, stream, output); },
               {}});
      }
      if (fp8_shape && which != moe::BackwardGemm::kGateUp)
        candidates.push_back({"pounce fp8",
                              Role::kPounce,
                              [&chain_fp8, which = which, stream](int) { chain_fp8->run_gemm(which, stream); },
                              {}});
      candidates.push_back(dense_reference);
      gemms[key] = compare(s.name, name, (gate_up ? 4.0 : 2.0) * routes * double(H) * double(I), candidates, o,
                           dense_tflops, report, stream);
    }
    if (fp8_shape) {
      // What the FP8 weight gradients' operands cost apart from their GEMMs: four quantization passes.
      gemms["fp8_weight_gradient_quantization"] =
          compare(s.name, "FP8 wgrad operands quantized", 0.0,
                  {{"pounce fp8",
                    Role::kPounce,
                    [&chain_fp8, stream](int) { chain_fp8->run_weight_gradient_quantization(stream); },
                    {}},
                   dense_reference},
                  o, dense_tflops, report, stream);
    }
    result["backward_gemms"] = gemms;
    CUDA_CHECK(cudaStreamSynchronize(stream));
    chain.check_device_errors();
    if (chain_fp8) chain_fp8->check_device_errors();
    for (FusedMoe* layer : {fused_backward_layer.get(), copying_x_layer.get()}) layer->check_device_errors();
  }
  if (!o.timeline_dir.empty()) {
    // The in-kernel timeline: what recording costs the forward (a recording layer timed beside `fused`,
    // which does not record), then the traces of one forward and of one training step.
    FusedMoe traced(one_rank);
    traced.set_weights({w13.data(), w2.data()});
    const int64_t tiles = fused.max_m_blocks() * (n_blocks(2 * I) + n_blocks(H));
    const int64_t spans_per_forward = 5 * tiles + 4 * fused.max_m_blocks() + 16 * int64_t(gpu_info().multiprocessors);
    traced.start_timeline((o.warmup + o.reps) * spans_per_forward);
    const std::vector<Timing> times = time_interleaved(
        std::vector<std::function<void(int)>>{[&](int rep) { fused_forward(fused, rep % kSets, y_fused.data()); },
                                              [&](int rep) { fused_forward(traced, rep % kSets, y_fused.data()); }},
        stream, o.warmup, o.reps);
    Json timeline = {{"forward_ms", times[0].median_ms},
                     {"forward_recording_ms", times[1].median_ms},
                     {"recording_overhead", times[1].median_ms / times[0].median_ms - 1.0}};
    std::printf("%-18s timeline: forward %.3f ms, recording %.3f ms (%+.1f%%)\n", s.name.c_str(), times[0].median_ms,
                times[1].median_ms, 100.0 * (times[1].median_ms / times[0].median_ms - 1.0));
    const auto save = [&](const char* what, const std::string& trace) {
      const std::string file = s.name + "-" + what + ".json", path = o.timeline_dir + "/" + file;
      FILE* f = std::fopen(path.c_str(), "w");
      POUNCE_REQUIRE(f != nullptr, "cannot write ", path);
      const bool written = std::fwrite(trace.data(), 1, trace.size(), f) == trace.size();
      POUNCE_REQUIRE(std::fclose(f) == 0 && written, "cannot write ", path);
      timeline[what] = file;  // in the --timeline folder
    };
    traced.start_timeline(spans_per_forward);
    fused_forward(traced, 0, y_fused.data());
    save("forward", traced.stop_timeline());
    // pounce's unfused chain on the same tokens: its two GEMMs alone, to set the fused kernel's tiles
    // beside the stand-alone engine's.
    Timeline unfused_timeline(spans_per_forward);
    unfused.set_timeline(unfused_timeline.sink());
    unfused.forward(x[0].data(), d_weights.data(), y_pounce.data(), stream);
    unfused.set_timeline({});
    save("unfused-forward", chrome_trace_json(unfused_timeline.events(), {"unfused GEMM1 (+SwiGLU)", "unfused GEMM2"}));
    if (fused_fp8) {
      // The E4M3 forward (the timed layer itself: its timing is done) and the unfused FP8 chain's two GEMMs
      // the same way; E4M3 tiles are 128 columns wide (twice the BF16 tiles), and the quantization items
      // come on top.
      fused_fp8->start_timeline(3 * spans_per_forward);
      fused_forward(*fused_fp8, 0, y_fused_fp8.data());
      save("forward-fp8", fused_fp8->stop_timeline());
      fused_fp8->check_device_errors();
      Timeline unfused_fp8_timeline(3 * spans_per_forward);
      unfused.set_timeline(unfused_fp8_timeline.sink());
      unfused.forward_fp8(x[0].data(), d_weights.data(), y_fp8.data(), stream);
      unfused.set_timeline({});
      save("unfused-forward-fp8",
           chrome_trace_json(unfused_fp8_timeline.events(), {"unfused FP8 GEMM1 (+SwiGLU)", "unfused FP8 GEMM2"}));
    }

    DeviceBuffer<__nv_bfloat16> dy(T * H), dx(T * H), dw13(E * 2 * I * H), dw2(E * H * I);
    DeviceBuffer<float> d_topk(T * k);
    fill_random_bf16(dy.data(), T * H, 300, 1.0f, stream);
    const RankIO io{x[0].data(), d_ids.data(), d_weights.data(), T, y_fused.data()};
    const RankGrads grads{dy.data(), dx.data(), d_topk.data(), dw13.data(), dw2.data()};
    // A training step with each backward: the chain of kernels (the default) and the fused kernel.
    FusedMoe traced_fused_backward(one_rank, {.fused_backward = true});
    traced_fused_backward.set_weights({w13.data(), w2.data()});
    for (auto [layer, what] :
         {std::pair{&traced, "training-step"}, std::pair{&traced_fused_backward, "training-step-fused-backward"}}) {
      layer->forward(io, stream, /*keep_for_backward=*/true);
      layer->backward(io, grads, WeightGradOutput::kBf16, stream);  // the first backward allocates its buffers
      layer->start_timeline(8 * spans_per_forward);                 // the backward's four GEMMs have more tiles
      layer->forward(io, stream, /*keep_for_backward=*/true);
      layer->backward(io, grads, WeightGradOutput::kBf16, stream);
      save(what, layer->stop_timeline());
      layer->check_device_errors();
    }
    result["timeline"] = timeline;
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  unfused.check_device_errors();
  fused.check_device_errors();
  return result;
}

}  // namespace pounce::bench
