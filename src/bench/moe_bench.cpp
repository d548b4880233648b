// Per-shape benchmark: the MoE forward through every implementation, then each grouped GEMM alone,
// all on the same weights, tokens and routing, in one process.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>

#include "baseline/cublas_moe.h"
#include "baseline/pounce_unfused.h"
#include "bench/bench.h"
#include "bench/dense_ceiling.h"
#include "bench/device_fill.h"
#include "common/relative_error.h"
#include "formats/numerics.h"
#include "moe/fused_moe.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {

namespace {

using baseline::Gemm;
using baseline::GemmCalls;

// Relative L2 difference of two bf16 device buffers of n elements.
double relative_difference(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n) {
  std::vector<float> values[2];
  for (int i = 0; i < 2; ++i) {
    std::vector<uint16_t> bits(n);
    CUDA_CHECK(cudaMemcpy(bits.data(), i == 0 ? a : b, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    for (uint16_t v : bits) values[i].push_back(formats::bf16_to_float(v));
  }
  return relative_l2_error(std::span<const float>(values[0]), std::span<const float>(values[1]));
}

struct Candidate {
  std::string impl;
  std::function<void(int rep)> launch;
  double flops = 0;  // 0: the step's
};

// Times the candidates (interleaved), adds rows (speedup against the slowest) and returns their JSON.
Json compare(const std::string& shape, const std::string& what, double flops, const std::vector<Candidate>& candidates,
             const Options& o, double dense_tflops, std::vector<Row>& table, cudaStream_t stream) {
  std::vector<std::function<void(int)>> launches;
  for (const Candidate& c : candidates) launches.push_back(c.launch);
  const std::vector<Timing> timings = time_interleaved(launches, stream, o.warmup, o.reps);
  std::vector<Row> rows;
  Json out = Json::array();
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    const Timing& t = timings[i];
    const double tflops = (c.flops > 0 ? c.flops : flops) / (t.median_ms * 1e-3) / 1e12;
    rows.push_back({shape, what, c.impl, t.median_ms, tflops, tflops / dense_tflops, 0});
    out.push_back({{"what", what}, {"impl", c.impl}, {"timing", t}, {"tflops", tflops},
                   {"fraction_of_dense_bf16", tflops / dense_tflops}});
  }
  // Speedups among the implementations of the step; reference rows (own flops) get none.
  double slowest = 0;
  for (size_t i = 0; i < rows.size(); ++i)
    if (candidates[i].flops == 0) slowest = std::max(slowest, rows[i].ms);
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i].speedup = candidates[i].flops == 0 ? slowest / rows[i].ms : 0;
    table.push_back(rows[i]);
  }
  return out;
}

}  // namespace

Json bench_shape(const MoeModelShape& s, const Options& o, double dense_tflops, std::vector<Row>& table,
                 cudaStream_t stream) {
  const int64_t T = s.slice_tokens, H = s.hidden, I = s.intermediate, E = s.slice_experts, k = s.topk;
  std::printf("\n%s: H %ld, I %ld, %ld local experts, %ld tokens, top-%ld, %s routing\n", s.name.c_str(), long(H),
              long(I), long(E), long(T), long(k), o.routing.c_str());
  std::fflush(stdout);
  std::mt19937_64 rng(42);  // benchmarks are reproducible; tests draw fresh inputs
  const auto ids = reference::synthetic_topk_ids(reference::parse_routing_pattern(o.routing), T, int(E), int(k), rng);
  const auto weights = reference::synthetic_topk_weights(T, int(k), rng);

  // Two token sets, rotated between repetitions; the weights (>= 100 MB) dwarf the L2 already.
  constexpr int kSets = 2;
  DeviceBuffer<__nv_bfloat16> w13(E * 2 * I * H), w2(E * H * I), y_cublas(T * H), y_pounce(T * H);
  std::vector<DeviceBuffer<__nv_bfloat16>> x;
  const float w_scale = 1.0f / std::sqrt(float(H));
  fill_random_bf16(w13.data(), w13.size(), 11, w_scale, stream);
  fill_random_bf16(w2.data(), w2.size(), 12, w_scale, stream);
  for (int i = 0; i < kSets; ++i) {
    x.emplace_back(T * H);
    fill_random_bf16(x.back().data(), T * H, 100 + i, 1.0f, stream);
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
  DeviceBuffer<__nv_bfloat16> y_fused(T * H);
  const planner::EpConfig one_rank{.ranks = 1, .experts = int(E), .topk = int(k), .hidden = H, .intermediate = I,
                                   .max_tokens_per_rank = T};
  moe::FusedMoe fused(one_rank);
  fused.set_weights(w13.data(), w2.data());
  auto fused_forward = [&](moe::FusedMoe& layer, int set, __nv_bfloat16* y) {
    const moe::RankIO io{x[set].data(), d_ids.data(), d_weights.data(), T, y};
    layer.forward(std::span(&io, 1), stream);
  };

  Json result = {{"shape", s.name}, {"hidden", H}, {"intermediate", I}, {"model_experts", s.model_experts},
                 {"local_experts", E}, {"tokens", T}, {"topk", k}, {"routing", o.routing}, {"routes", plan.routes},
                 {"padded_rows", plan.padded_rows}, {"expert_routes", plan.expert_routes},
                 {"forward_flops", s.forward_flops()}};

  // Same inputs through both chains once: their outputs must agree before their times mean anything.
  cublas.forward(x[0].data(), d_weights.data(), y_cublas.data(), GemmCalls::kGroupedBatched, stream);
  unfused.forward(x[0].data(), d_weights.data(), y_pounce.data(), stream);
  fused_forward(fused, 0, y_fused.data());
  CUDA_CHECK(cudaStreamSynchronize(stream));
  unfused.check_device_errors();
  fused.check_device_errors();
  Json agreement = Json::object();
  agreement["y_pounce_unfused_vs_cublas"] = relative_difference(y_pounce.data(), y_cublas.data(), T * H);
  agreement["y_pounce_fused_vs_cublas"] = relative_difference(y_fused.data(), y_cublas.data(), T * H);
  agreement["hidden_pounce_vs_cublas"] = relative_difference(unfused.hidden(), cublas.hidden(), plan.padded_rows * I);
  result["relative_l2_difference"] = agreement;

  // The dense ceiling timed interleaved with every comparison: same clocks, same temperature (under
  // sustained load the H200 runs at its power cap and lowers its clocks).
  DenseBf16Gemm dense(8192);
  const Candidate dense_reference{"cublas dense 8192^3", [&](int) { dense.run(stream); }, dense.flops()};

  std::vector<Candidate> forward;
  for (GemmCalls calls : {GemmCalls::kLoop, GemmCalls::kGroupedBatched})
    forward.push_back({baseline::gemm_calls_name(calls), [&, calls](int rep) {
                         cublas.forward(x[rep % kSets].data(), d_weights.data(), y_cublas.data(), calls, stream);
                       }});
  forward.push_back({"pounce_unfused", [&](int rep) {
                       unfused.forward(x[rep % kSets].data(), d_weights.data(), y_pounce.data(), stream);
                     }});
  // The chain as the fused layer runs it: routing in device memory, scheduled on the GPU every forward.
  forward.push_back({"pounce_unfused, device schedule", [&](int rep) {
                       unfused.forward_with_device_schedule(x[rep % kSets].data(), d_ids.data(), T, d_weights.data(),
                                                            y_pounce.data(), stream);
                     }});
  // The unfused chain's two GEMMs alone, on the rows its last forward permuted: what the chain's other
  // steps (permute, combine, planning) add, under the same clocks.
  forward.push_back({"pounce GEMM1 + GEMM2 alone", [&](int) {
                       unfused.run_gemm(Gemm::kGateUp, stream);
                       unfused.run_gemm(Gemm::kDown, stream);
                     }});
  forward.push_back({"pounce_fused", [&](int rep) { fused_forward(fused, rep % kSets, y_fused.data()); }});
  forward.push_back(dense_reference);
  result["forward"] = compare(s.name, "forward", s.forward_flops(), forward, o, dense_tflops, table, stream);
  result["fused_config"] = {{"comm_ctas", fused.comm_ctas()}, {"engine_rows", fused.engine_rows()},
                            {"ctas_per_rank", fused.ctas_per_rank()}, {"minibatch_rows", fused.minibatch_rows()},
                            {"ring_blocks", fused.ring_blocks()}};

  if (o.sweeps) {
    // Each setting is its own layer on the same inputs, timed interleaved with the others and the default.
    auto sweep = [&](const std::string& what, const std::vector<std::pair<std::string, moe::FusedMoeOptions>>& settings,
                     int ranks = 1) {
      std::vector<std::unique_ptr<moe::FusedMoe>> layers;
      std::vector<Candidate> candidates;
      for (const auto& [name, options] : settings) {
        planner::EpConfig config = one_rank;
        config.ranks = ranks;
        config.max_tokens_per_rank = (T + ranks - 1) / ranks;
        layers.push_back(std::make_unique<moe::FusedMoe>(config, options));
        layers.back()->set_weights(w13.data(), w2.data());
        moe::FusedMoe* layer = layers.back().get();
        candidates.push_back({name, [&, layer, ranks](int rep) {
                                // Rank r holds tokens [r T/P, (r+1) T/P) of the same batch.
                                std::vector<moe::RankIO> io(ranks);
                                const int64_t per_rank = (T + ranks - 1) / ranks;
                                for (int r = 0; r < ranks; ++r) {
                                  const int64_t first = std::min(T, r * per_rank), n = std::min(T - first, per_rank);
                                  io[r] = {x[rep % kSets].data() + first * H, d_ids.data() + first * k,
                                           d_weights.data() + first * k, n, y_fused.data() + first * H};
                                }
                                layer->forward(io, stream);
                              }});
      }
      candidates.push_back({"pounce_unfused", [&](int rep) {
                              unfused.forward(x[rep % kSets].data(), d_weights.data(), y_pounce.data(), stream);
                            }});
      candidates.push_back(dense_reference);
      Json j = Json::object();
      j["timings"] = compare(s.name, what, s.forward_flops(), candidates, o, dense_tflops, table, stream);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      Json configs = Json::array();
      for (size_t i = 0; i < layers.size(); ++i) {
        layers[i]->check_device_errors();
        configs.push_back({{"impl", settings[i].first}, {"minibatch_rows", layers[i]->minibatch_rows()},
                           {"comm_ctas", layers[i]->comm_ctas()}, {"engine_rows", layers[i]->engine_rows()},
                           {"ring_blocks", layers[i]->ring_blocks()}, {"ctas_per_rank", layers[i]->ctas_per_rank()}});
      }
      j["layers"] = configs;
      return j;
    };
    Json sweeps = Json::object();
    std::vector<std::pair<std::string, moe::FusedMoeOptions>> settings;
    // Communication CTAs at every shape: how many a layer needs depends on its bytes moved per FLOP.
    for (int comm : {2, 4, 6, 8, 10, 12, 16, 24, 32, 40}) {
      moe::FusedMoeOptions m;
      m.comm_ctas = comm;
      settings.push_back({"comm CTAs " + std::to_string(comm), m});
    }
    sweeps["comm_ctas"] = sweep("fused: comm CTAs", settings);
    settings.clear();
    if (s.name == default_shape().name) {
      for (int blocks : {2, 4, 8, 16, 32, 64}) {
        moe::FusedMoeOptions m;
        m.minibatch_rows = int64_t(blocks) * planner::kBlockM;
        settings.push_back({"minibatch " + std::to_string(blocks) + " m-blocks", m});
      }
      sweeps["minibatch"] = sweep("fused: minibatch", settings);
      settings.clear();
      for (int rows : {0, 32, 48, 64, 96, 128}) {
        moe::FusedMoeOptions m;
        m.engine_rows = rows;
        settings.push_back({"engine rows " + std::to_string(rows), m});
      }
      sweeps["engine_rows"] = sweep("fused: engine rows", settings);
      settings.clear();
      // The smallest ring with the default layer's minibatch and comm CTAs: rows combined through slots
      // reused all forward, against the default (at one rank: in place, nothing combined).
      moe::FusedMoeOptions min_ring;
      min_ring.minibatch_rows = fused.minibatch_rows();
      min_ring.comm_ctas = fused.comm_ctas();
      min_ring.ring_blocks = 2 * ((fused.minibatch_rows() + planner::kBlockM - 1) / planner::kBlockM);
      settings.push_back({std::string("ring default, ") + std::to_string(fused.ring_blocks()) + " m-blocks", {}});
      settings.push_back({std::string("ring minimum, ") + std::to_string(min_ring.ring_blocks) + " m-blocks", min_ring});
      sweeps["ring"] = sweep("fused: ring", settings);
      Json ranks = Json::object();
      for (const char* P : {"1", "2", "4", "8"})
        ranks[std::string("P") + P] = sweep("fused: virtual ranks", {{std::string("P=") + P, {}}}, std::atoi(P));
      sweeps["virtual_ranks"] = ranks;
    }
    result["fused_sweeps"] = sweeps;
  }

  if (o.gemms) {
    const double routes = double(plan.routes);
    Json gemms = Json::object();
    for (Gemm which : {Gemm::kGateUp, Gemm::kDown}) {
      const bool gate_up = which == Gemm::kGateUp;
      std::vector<Candidate> candidates;
      for (GemmCalls calls : {GemmCalls::kLoop, GemmCalls::kGroupedBatched})
        candidates.push_back({baseline::gemm_calls_name(calls),
                              [&, calls, which](int) { cublas.run_gemm(which, calls, stream); }});
      candidates.push_back({gate_up ? "pounce (SwiGLU fused)" : "pounce", [&, which](int) {
                              unfused.run_gemm(which, stream, gemm::GemmTuning{});
                            }});
      // Tuning sweep, recorded so the default stays justified by measurement.
      for (int band : {8, 32})
        candidates.push_back({"pounce, band " + std::to_string(band), [&, which, band](int) {
                                unfused.run_gemm(which, stream, gemm::GemmTuning{.band_m_blocks = band});
                              }});
      candidates.push_back(dense_reference);
      const double flops = gate_up ? 2.0 * routes * 2 * I * H : 2.0 * routes * H * I;
      gemms[gate_up ? "gemm1_gate_up" : "gemm2_down"] =
          compare(s.name, gate_up ? "GEMM1 gate/up" : "GEMM2 down", flops, candidates, o, dense_tflops, table, stream);
    }
    result["grouped_gemms"] = gemms;
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  unfused.check_device_errors();
  fused.check_device_errors();
  return result;
}

}  // namespace pounce::bench
