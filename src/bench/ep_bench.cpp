// pounce_ep_bench: the fused layer expert-parallel across every visible GPU (up to 8, one NCCL rank per
// GPU, one process, a thread per GPU), at a catalogue shape with its model's full expert count split
// over the GPUs and the slice's tokens on every rank, timed interleaved with pounce's unfused
// expert-parallel chain (NCCL all-to-all, pounce's grouped GEMMs, all-to-all back; baseline/unfused_ep.h)
// on the same inputs. Reports each forward's time (the slowest rank's median), per-GPU TFLOP/s, the
// NVLink bytes each GPU sent and received per second (the same rows either way), and how far the two
// outputs are apart; then the training step (a forward that keeps its rows and the backward across GPUs
// from them) of both, timed interleaved the same way, with how far their dx are apart. JSON to --json;
// options: --help.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>

#include "baseline/unfused_ep.h"
#include "bench/bench.h"
#include "bench/cli.h"
#include "bench/device_fill.h"
#include "bench/guarded_main.h"
#include "bench/output_check.h"
#include "comm/gpu_threads.h"
#include "comm/nccl_window.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "pounce/fused_moe.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {
namespace {

int run(int argc, char** argv) {
  std::string shape_name = default_shape().name, routing = "uniform", json_path;
  int reps = 20;
  const int warmup = 5;
  FusedMoeOptions options;
  CLI::App app("pounce_ep_bench: the fused layer expert-parallel across every visible GPU (up to 8)");
  app.option_defaults()->always_capture_default();
  app.add_option("--shape", shape_name, "catalogue shape")->check(CLI::IsMember(shape_names()));
  app.add_option("--routing", routing, "synthetic routing pattern")->check(CLI::IsMember(routing_names()));
  app.add_option("--reps", reps, "timed forwards per rank (the median is reported)")->check(at_least(1));
  app.add_option("--comm-ctas", options.comm_ctas, "communication CTAs per rank; 0: the layer's default")
      ->check(at_least(0));
  app.add_option("--json", json_path, "write the results to this file");
  CLI11_PARSE(app, argc, argv);
  comm::disable_multicast();
  int gpus = 0;
  CUDA_CHECK(cudaGetDeviceCount(&gpus));
  const int P = std::min(gpus, 8);
  POUNCE_REQUIRE(P >= 1, "pounce_ep_bench needs a GPU");
  if (P == 1) std::printf("one GPU: nothing crosses NVLink (a run of the benchmark's code, not a measurement of EP)\n");
  const MoeModelShape s = select_shapes(shape_name).front();
  POUNCE_REQUIRE(s.model_experts % P == 0, s.name, ": ", s.model_experts, " experts do not split over ", P, " GPUs");
  const EpConfig config{.ranks = P,
                        .experts = int(s.model_experts),
                        .topk = int(s.topk),
                        .hidden = s.hidden,
                        .intermediate = s.intermediate,
                        .max_tokens_per_rank = s.slice_tokens};
  const int64_t T = s.slice_tokens, H = s.hidden, I = s.intermediate, E = s.model_experts, k = s.topk;
  std::printf("%s over %d GPUs: %ld experts (%ld per GPU), %ld tokens per GPU, top-%ld, %s routing\n", s.name.c_str(),
              P, long(E), long(E / P), long(T), long(k), routing.c_str());

  // Routing of every rank, and what crosses NVLink: a route whose expert lives on another GPU is pulled
  // there (H bf16) and its output pushed back (H bf16).
  std::mt19937_64 rng(42);
  std::vector<std::vector<int32_t>> ids(P);
  std::vector<std::vector<float>> weights(P);
  std::vector<double> sent(P, 0), received(P, 0), routes_in(P, 0);
  for (int r = 0; r < P; ++r) {
    ids[r] = reference::synthetic_topk_ids(reference::parse_routing_pattern(routing), T, int(E), int(k), rng);
    weights[r] = reference::synthetic_topk_weights(T, int(k), rng);
    for (int32_t e : ids[r]) {
      const int owner = int(e / (E / P));
      routes_in[owner] += 1;
      if (owner == r) continue;
      sent[r] += 2.0 * H;  // the token row, pulled by the owner
      received[owner] += 2.0 * H;
      received[r] += 2.0 * H;  // its output, pushed back
      sent[owner] += 2.0 * H;
    }
  }

  const int64_t w13_elems = E / P * 2 * I * H, w2_elems = E / P * H * I;
  std::vector<ncclComm_t> comms = comm::init_single_process_comms_on_first(P);
  std::vector<Timing> timings(P), unfused_timings(P), step_timings(P), unfused_step_timings(P);
  std::vector<OutputError> unfused_vs_fused(P), unfused_vs_fused_dx(P);
  int comm_ctas = 0;
  int64_t layer_bytes = 0;
  std::vector<std::optional<DeviceBuffer<__nv_bfloat16>>> w13(P), w2(P), x(P), y(P), y_unfused(P);
  std::vector<std::optional<DeviceBuffer<int32_t>>> d_ids(P);
  std::vector<std::optional<DeviceBuffer<float>>> d_weights(P);
  std::vector<std::optional<FusedMoe>> layers(P);
  std::vector<std::optional<baseline::UnfusedEpMoe>> unfused(P);
  const std::vector<std::string> failures = comm::run_on_every_gpu(
      P,
      [&](int r) {
        // Each GPU holds its own experts' weights only.
        w13[r].emplace(w13_elems);
        w2[r].emplace(w2_elems);
        x[r].emplace(T * H);
        y[r].emplace(T * H);
        y_unfused[r].emplace(T * H);
        fill_random_bf16(w13[r]->data(), w13[r]->size(), 11, 1.0f / std::sqrt(float(H)), nullptr);
        fill_random_bf16(w2[r]->data(), w2[r]->size(), 12, 1.0f / std::sqrt(float(H)), nullptr);
        fill_random_bf16(x[r]->data(), x[r]->size(), 100 + r, 1.0f, nullptr);
        d_ids[r].emplace(ids[r]);
        d_weights[r].emplace(weights[r]);
      },
      [&](int r) {
        FusedMoe& layer = layers[r].emplace(config, comms[r], options);
        if (r == 0) comm_ctas = layer.comm_ctas(), layer_bytes = layer.device_bytes();
        layer.set_weights({w13[r]->data(), w2[r]->data()});
        const RankIO io{x[r]->data(), d_ids[r]->data(), d_weights[r]->data(), T, y[r]->data()};
        baseline::UnfusedEpMoe& chain = unfused[r].emplace(config, r);
        chain.set_weights(w13[r]->data(), w2[r]->data());
        chain.set_routing(ids);
        const auto unfused_forward = [&] {
          chain.permute_for_dispatch(x[r]->data(), nullptr);
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kDispatch), comms[r], nullptr);
          chain.run_experts(nullptr);
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kReturn), comms[r], nullptr);
          chain.combine(d_weights[r]->data(), y_unfused[r]->data(), nullptr);
        };
        // Every rank launches its forwards back to back, the two layers alternating in the same order on
        // every rank (the fused forward's start handshake and NCCL's exchanges line the ranks up).
        const std::vector<Timing> both = time_interleaved(
            std::vector<std::function<void(int)>>{[&](int) { layer.forward(std::span(&io, 1), nullptr); },
                                                  [&](int) { unfused_forward(); }},
            nullptr, warmup, reps);  // its seeded shuffle gives every rank the same order
        timings[r] = both[0];
        unfused_timings[r] = both[1];
        RowComparison compare(T);
        compare.enqueue(y_unfused[r]->data(), y[r]->data(), H, nullptr, nullptr);
        const cudaError_t synced = cudaDeviceSynchronize();
        layer.check_device_errors();
        chain.check_device_errors();
        CUDA_CHECK(synced);
        unfused_vs_fused[r] = compare.error();

        // The training step of both: a forward that keeps its rows, then the backward across GPUs from
        // them (bf16 weight gradients, what the Python package asks for). The unfused chain sends the
        // dy rows and router weights out and the dx rows and route dots back, each pair in one NCCL group.
        DeviceBuffer<__nv_bfloat16> dy(T * H), dx(T * H), dw13(w13_elems), dw2(w2_elems);
        DeviceBuffer<__nv_bfloat16> u_dx(T * H), u_dw13(w13_elems), u_dw2(w2_elems);
        DeviceBuffer<float> d_topk(T * k), u_d_topk(T * k);
        fill_random_bf16(dy.data(), dy.size(), 300 + r, 1.0f, nullptr);
        const RankGrads grads{dy.data(), dx.data(), d_topk.data(), dw13.data(), dw2.data()};
        const auto unfused_step = [&] {
          chain.permute_for_dispatch(x[r]->data(), nullptr);
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kDispatch), comms[r], nullptr);
          chain.run_experts(nullptr, /*keep_for_backward=*/true);
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kReturn), comms[r], nullptr);
          chain.combine(d_weights[r]->data(), y_unfused[r]->data(), nullptr);
          chain.permute_for_backward(dy.data(), d_weights[r]->data(), nullptr);
          NCCL_CHECK(ncclGroupStart());
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kDispatch), comms[r], nullptr);
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kWeights), comms[r], nullptr);
          NCCL_CHECK(ncclGroupEnd());
          chain.run_experts_backward(u_dw13.data(), u_dw2.data(), WeightGradOutput::kBf16, nullptr);
          NCCL_CHECK(ncclGroupStart());
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kReturn), comms[r], nullptr);
          baseline::exchange_over_nccl(chain.exchange(baseline::Exchange::kDots), comms[r], nullptr);
          NCCL_CHECK(ncclGroupEnd());
          chain.combine_backward(u_dx.data(), u_d_topk.data(), nullptr);
        };
        const std::vector<Timing> steps = time_interleaved(
            std::vector<std::function<void(int)>>{[&](int) {
                                                    layer.forward(std::span(&io, 1), nullptr,
                                                                  /*keep_for_backward=*/true);
                                                    layer.backward(std::span(&io, 1), std::span(&grads, 1),
                                                                   WeightGradOutput::kBf16, nullptr);
                                                  },
                                                  [&](int) { unfused_step(); }},
            nullptr, warmup, reps);
        step_timings[r] = steps[0];
        unfused_step_timings[r] = steps[1];
        RowComparison compare_dx(T);
        compare_dx.enqueue(u_dx.data(), dx.data(), H, nullptr, nullptr);
        const cudaError_t stepped = cudaDeviceSynchronize();
        layer.check_device_errors();
        chain.check_device_errors();
        CUDA_CHECK(stepped);
        unfused_vs_fused_dx[r] = compare_dx.error();
      },
      [&](int r) {
        layers[r].reset();
        unfused[r].reset();
        y_unfused[r].reset();
        w13[r].reset(), w2[r].reset(), x[r].reset(), y[r].reset(), d_ids[r].reset(), d_weights[r].reset();
      });
  comm::destroy_single_process_comms(comms);
  for (int r = 0; r < P; ++r) POUNCE_REQUIRE(failures[r].empty(), "rank ", r, ": ", failures[r]);

  double slowest = 0, unfused_slowest = 0, step_slowest = 0, unfused_step_slowest = 0;
  for (int r = 0; r < P; ++r) {
    slowest = std::max(slowest, timings[r].median_ms);
    unfused_slowest = std::max(unfused_slowest, unfused_timings[r].median_ms);
    step_slowest = std::max(step_slowest, step_timings[r].median_ms);
    unfused_step_slowest = std::max(unfused_step_slowest, unfused_step_timings[r].median_ms);
  }
  const char* commit = std::getenv("POUNCE_COMMIT");
  Json out = {{"gpu", gpu_info().name},
              {"commit", commit ? commit : "unknown"},
              {"shape", s.name},
              {"gpus", P},
              {"routing", routing},
              {"tokens_per_gpu", T},
              {"comm_ctas", comm_ctas},
              {"forward_ms_slowest_rank", slowest},
              {"unfused_forward_ms_slowest_rank", unfused_slowest},
              {"speedup_vs_unfused", unfused_slowest / slowest},
              {"training_step_ms_slowest_rank", step_slowest},
              {"unfused_training_step_ms_slowest_rank", unfused_step_slowest},
              {"training_step_speedup_vs_unfused", unfused_step_slowest / step_slowest}};
  // Memory per GPU: its experts' weights, and what the layer allocated (ring, schedule, combine slots).
  const int64_t weight_bytes = int64_t(w13_elems + w2_elems) * 2;
  out["weight_bytes_per_gpu"] = weight_bytes;
  out["layer_device_bytes_per_gpu"] = layer_bytes;
  std::printf("per GPU: %.2f GiB of expert weights (%ld of %ld experts), %.2f GiB of layer buffers\n",
              weight_bytes / double(1 << 30), long(E / P), long(E), layer_bytes / double(1 << 30));
  Json ranks = Json::array();
  std::printf("%d communication CTAs per rank\n", comm_ctas);
  std::printf("fused %.3f ms, unfused expert-parallel chain %.3f ms (slowest ranks' medians): %.3fx\n", slowest,
              unfused_slowest, unfused_slowest / slowest);
  std::printf(
      "training step (forward keeping its rows + backward across GPUs): fused %.3f ms, unfused chain %.3f ms "
      "(slowest ranks' medians): %.3fx\n",
      step_slowest, unfused_step_slowest, unfused_step_slowest / step_slowest);
  std::printf(
      "rank  fused ms  TFLOP/s  NVLink GB/s out  in  unfused ms  NVLink GB/s out  in  unfused vs fused: y, dx "
      "(rel. L2)\n");
  bool outputs_agree = true;
  for (int r = 0; r < P; ++r) {
    const double flops = 6.0 * routes_in[r] * double(H) * double(I);
    const double tflops = flops / (slowest * 1e-3) / 1e12;
    const double out_gbps = sent[r] / (slowest * 1e-3) / 1e9, in_gbps = received[r] / (slowest * 1e-3) / 1e9;
    const double u_out = sent[r] / (unfused_slowest * 1e-3) / 1e9, u_in = received[r] / (unfused_slowest * 1e-3) / 1e9;
    const OutputError& e = unfused_vs_fused[r];
    const OutputError& e_dx = unfused_vs_fused_dx[r];
    outputs_agree = outputs_agree && e.relative_l2 < kMaxRelativeL2 && e.worst_row < kMaxWorstToken &&
                    e_dx.relative_l2 < kMaxRelativeL2 && e_dx.worst_row < kMaxWorstToken;
    std::printf("%4d  %8.3f  %7.1f  %15.1f  %4.1f  %10.3f  %15.1f  %4.1f  %.2e, %.2e\n", r, timings[r].median_ms,
                tflops, out_gbps, in_gbps, unfused_timings[r].median_ms, u_out, u_in, e.relative_l2, e_dx.relative_l2);
    ranks.push_back({{"rank", r},
                     {"timing", timings[r]},
                     {"tflops_at_slowest", tflops},
                     {"nvlink_out_gbps", out_gbps},
                     {"nvlink_in_gbps", in_gbps},
                     {"unfused_timing", unfused_timings[r]},
                     {"unfused_tflops_at_slowest", flops / (unfused_slowest * 1e-3) / 1e12},
                     {"unfused_nvlink_out_gbps", u_out},
                     {"unfused_nvlink_in_gbps", u_in},
                     {"unfused_vs_fused", {{"relative_l2", e.relative_l2}, {"worst_token", e.worst_row}}},
                     // A training step moves every remote row twice each way: x and dy out, y and dx back.
                     {"training_step_timing", step_timings[r]},
                     {"training_step_tflops_at_slowest", 3 * flops / (step_slowest * 1e-3) / 1e12},
                     {"training_step_nvlink_out_gbps", 2 * sent[r] / (step_slowest * 1e-3) / 1e9},
                     {"training_step_nvlink_in_gbps", 2 * received[r] / (step_slowest * 1e-3) / 1e9},
                     {"unfused_training_step_timing", unfused_step_timings[r]},
                     {"unfused_vs_fused_dx", {{"relative_l2", e_dx.relative_l2}, {"worst_token", e_dx.worst_row}}}});
  }
  out["ranks"] = ranks;
  out["outputs_agree"] = outputs_agree;
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << '\n';
  POUNCE_REQUIRE(outputs_agree,
                 "the unfused chain's output or dx and the fused layer's differ beyond the limits (relative L2 ",
                 kMaxRelativeL2, ", worst token ", kMaxWorstToken, "): see the table");
  return 0;
}

}  // namespace
}  // namespace pounce::bench

int main(int argc, char** argv) {
  return pounce::bench::guarded_main("pounce_ep_bench", pounce::bench::run, argc, argv);
}
