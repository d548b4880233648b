// pounce_dispatch_bench: dispatch only, pull against push (docs/dispatch_probe.md; moe/dispatch_probe.h). The
// DeepSeek-V3 slice (H 7168, top-8, 8192 tokens per rank, 256 experts split over the ranks), uniform
// routing: how long after a synchronized start each rank's first m-block is in its ring (when the first
// expert tile could start), and when every m-block is. Virtual ranks P = 1, 2, 4, 8 on GPU 0, then one
// NCCL rank per visible GPU when there are at least two. Medians over --reps runs after --warmup; the
// two modes alternate run by run so drift affects both alike.
//
// Options: --help. $POUNCE_COMMIT is recorded in the JSON.
#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <random>

#include "bench/bench.h"
#include "bench/cli.h"
#include "bench/device_fill.h"
#include "bench/guarded_main.h"
#include "comm/gpu_threads.h"
#include "comm/nccl_window.h"
#include "common/gpu.h"
#include "dispatch_probe/dispatch_probe.h"
#include "moe/fused_params.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {
namespace {

using moe::DispatchMode;
using moe::DispatchRankTimes;
constexpr DispatchMode kModes[] = {DispatchMode::kPull, DispatchMode::kPush};

struct Settings {
  int comm_ctas = 12, engine_rows = -1, warmup = 5, reps = 20;
  int64_t ring_blocks = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The timed runs of one mode: [rep] -> every rank's times (all ranks, whichever GPU ran them).
struct Series {
  std::vector<std::vector<DispatchRankTimes>> reps;
  std::vector<double> launch_ms;  // per rep, the slowest GPU's launch
};

// One table row and its JSON: the slowest rank per run, median over runs.
Json summarize(DispatchMode mode, const char* transport, int P, int gpus, int comm_ctas, int64_t row_bytes,
               const Series& s) {
  std::vector<double> first, all;
  for (const auto& ranks : s.reps) {
    double f = 0, a = 0;
    for (const DispatchRankTimes& t : ranks) f = std::max(f, t.first_us), a = std::max(a, t.all_us);
    first.push_back(f);
    all.push_back(a);
  }
  const std::vector<DispatchRankTimes>& any = s.reps.front();
  int64_t bytes = 0, remote_bytes = 0;
  for (const DispatchRankTimes& t : any) bytes += t.bytes, remote_bytes += t.remote_rows * row_bytes;
  const double first_us = median(first), all_us = median(all), launch_ms = median(s.launch_ms);
  const double gbps = all_us > 0 ? double(bytes) / gpus / (all_us * 1e-6) / 1e9 : 0;
  std::printf("%-5s %-9s %2d %5d %14.1f %13.1f %10.3f %9.1f\n", moe::dispatch_mode_name(mode), transport, P, comm_ctas,
              first_us, all_us, launch_ms, gbps);
  Json j = {{"mode", moe::dispatch_mode_name(mode)},
            {"transport", transport},
            {"ranks", P},
            {"gpus", gpus},
            {"comm_ctas", comm_ctas},
            {"first_tile_us_slowest_rank", first_us},
            {"all_ready_us_slowest_rank", all_us},
            {"launch_ms", launch_ms},
            {"bytes_moved", bytes},
            {"bytes_from_other_ranks", remote_bytes},
            {"gbps_per_gpu", gbps}};
  Json per_rank = Json::array();
  for (size_t r = 0; r < any.size(); ++r) {
    std::vector<double> f, a;
    for (const auto& ranks : s.reps) f.push_back(ranks[r].first_us), a.push_back(ranks[r].all_us);
    per_rank.push_back({{"rank", any[r].rank},
                        {"m_blocks", any[r].blocks},
                        {"rows", any[r].rows},
                        {"remote_rows", any[r].remote_rows},
                        {"first_tile_us", median(f)},
                        {"all_ready_us", median(a)}});
  }
  j["per_rank"] = per_rank;
  return j;
}

// Warm-up, then timed runs of both modes, alternating; returns this caller's timed runs [mode][rep] (its
// ranks only: on NCCL every GPU's thread calls it, in step through each run's start barrier).
std::array<std::vector<moe::DispatchRun>, 2> measure(const Settings& o, moe::DispatchProbe& probe) {
  std::array<std::vector<moe::DispatchRun>, 2> runs;
  for (int i = 0; i < o.warmup + o.reps; ++i)
    for (int m = 0; m < 2; ++m) {
      moe::DispatchRun r = probe.run(kModes[m], nullptr);
      if (i >= o.warmup) runs[m].push_back(std::move(r));
    }
  return runs;
}

// Adds one caller's runs of a mode to the series (several callers: one per GPU).
void add(Series& s, const std::vector<moe::DispatchRun>& runs) {
  s.reps.resize(runs.size());
  s.launch_ms.resize(runs.size(), 0);
  for (size_t i = 0; i < runs.size(); ++i) {
    s.reps[i].insert(s.reps[i].end(), runs[i].ranks.begin(), runs[i].ranks.end());
    s.launch_ms[i] = std::max(s.launch_ms[i], runs[i].launch_ms);
  }
}

int run(int argc, char** argv) {
  Settings o;
  std::string json_path;
  CLI::App app("pounce_dispatch_bench: dispatch only, pull against push, on the DeepSeek-V3 slice");
  app.option_defaults()->always_capture_default();
  app.add_option("--comm-ctas", o.comm_ctas, "row-moving CTAs per rank")->check(at_least(1));
  app.add_option("--engine-rows", o.engine_rows,
                 "rows of each 128-row item the bulk-copy engine moves beside the warps; -1: the fused layer's "
                 "default for the row length (moe::balanced_engine_rows)")
      ->check(CLI::Range(-1, 128));
  app.add_option("--ring-blocks", o.ring_blocks, "m-blocks moved per rank; 0: every m-block")->check(at_least(0));
  app.add_option("--reps", o.reps, "timed runs of each mode (medians are reported)")->check(at_least(1));
  app.add_option("--warmup", o.warmup, "untimed runs of each mode first")->check(at_least(0));
  app.add_option("--json", json_path, "write the results to this file");
  CLI11_PARSE(app, argc, argv);
  comm::disable_multicast();  // before any NCCL initialization
  POUNCE_REQUIRE(gpu_is_hopper(), "pounce_dispatch_bench needs a Hopper GPU; this one is ",
                 gpu_info().present ? gpu_info().name : gpu_info().why_absent);
  int gpus = 0;
  CUDA_CHECK(cudaGetDeviceCount(&gpus));
  const MoeModelShape shape = select_shapes("deepseek_v3").front();
  const int64_t T = shape.slice_tokens, H = shape.hidden;
  const char* commit = std::getenv("POUNCE_COMMIT");
  // What the probe will use (it checks the option's range itself).
  const int engine_rows = o.engine_rows >= 0 ? o.engine_rows : moe::balanced_engine_rows(2 * H);
  std::printf(
      "GPU %s x %d, commit %s: %s dispatch, H %ld, top-%ld, %ld tokens per rank, %ld experts over the "
      "ranks, uniform routing, %d comm CTAs of 384 threads, %d engine rows per item, ring %s, median of "
      "%d runs\n",
      gpu_info().name.c_str(), gpus, commit ? commit : "unknown", shape.name.c_str(), long(H), long(shape.topk),
      long(T), long(shape.model_experts), o.comm_ctas, engine_rows,
      o.ring_blocks ? std::to_string(o.ring_blocks).c_str() : "every m-block", o.reps);
  std::printf("mode  transport  P  comm  first-tile us  all-ready us  launch ms  GB/s/GPU\n");

  Json doc = {{"gpu", gpu_info().name},
              {"visible_gpus", gpus},
              {"commit", commit ? commit : "unknown"},
              {"shape", shape.name},
              {"hidden", H},
              {"topk", shape.topk},
              {"experts", shape.model_experts},
              {"tokens_per_rank", T},
              {"routing", "uniform"},
              {"engine_rows", engine_rows},
              {"ring_blocks_option", o.ring_blocks},
              {"reps", o.reps},
              {"warmup", o.warmup}};
  Json rows = Json::array();

  std::mt19937_64 rng(42);
  auto config_for = [&](int P) {
    return EpConfig{.ranks = P,
                    .experts = int(shape.model_experts),
                    .topk = int(shape.topk),
                    .hidden = H,
                    .intermediate = shape.intermediate,
                    .max_tokens_per_rank = T};
  };
  auto routing_for = [&](int P) {
    std::vector<std::vector<int32_t>> ids;
    for (int r = 0; r < P; ++r)
      ids.push_back(reference::synthetic_topk_ids(reference::RoutingPattern::kUniform, T, int(shape.model_experts),
                                                  int(shape.topk), rng));
    return ids;
  };
  const moe::DispatchProbeOptions options{
      .comm_ctas = o.comm_ctas, .engine_rows = o.engine_rows, .ring_blocks = o.ring_blocks};

  // Virtual ranks on GPU 0.
  CUDA_CHECK(cudaSetDevice(0));
  for (int P : {1, 2, 4, 8}) {
    if (P * (o.comm_ctas + 1) > gpu_info().multiprocessors) {
      std::printf("(virtual P = %d: %d CTAs exceed the GPU's %d SMs; skipped)\n", P, P * (o.comm_ctas + 1),
                  gpu_info().multiprocessors);
      continue;
    }
    const auto ids = routing_for(P);
    moe::DispatchProbe probe(config_for(P), ids, options);
    for (int r = 0; r < P; ++r) fill_random_bf16(probe.x(r), T * H, 100 + r, 1.0f, nullptr);
    const auto runs = measure(o, probe);
    for (int m = 0; m < 2; ++m) {
      Series series;
      add(series, runs[m]);
      rows.push_back(summarize(kModes[m], "virtual", P, 1, o.comm_ctas, 2 * H, series));
    }
  }

  // One NCCL rank per GPU.
  const int P = std::min(gpus, 8);
  if (P < 2) {
    std::printf("(one GPU: no NCCL row)\n");
  } else if (shape.model_experts % P != 0) {
    std::printf("(%d GPUs: %ld experts do not split over them; no NCCL row)\n", P, long(shape.model_experts));
  } else {
    doc["nccl"] = comm::checked_nccl_version();
    const auto ids = routing_for(P);
    std::vector<ncclComm_t> comms = comm::init_single_process_comms_on_first(P);
    std::vector<std::optional<moe::DispatchProbe>> probes(P);
    std::vector<std::array<std::vector<moe::DispatchRun>, 2>> runs(P);  // [rank][mode][rep]
    const std::vector<std::string> failures = comm::run_on_every_gpu(
        P, [](int) {},
        [&](int r) {
          moe::DispatchProbe& probe = probes[r].emplace(config_for(P), ids, comms[r], options);
          fill_random_bf16(probe.x(r), T * H, 100 + r, 1.0f, nullptr);
          runs[r] = measure(o, probe);  // every rank the same sequence of runs
        },
        [&](int r) { probes[r].reset(); });
    comm::destroy_single_process_comms(comms);
    for (int r = 0; r < P; ++r) POUNCE_REQUIRE(failures[r].empty(), "NCCL rank ", r, ": ", failures[r]);
    for (int m = 0; m < 2; ++m) {
      Series series;
      for (int r = 0; r < P; ++r) add(series, runs[r][m]);
      rows.push_back(summarize(kModes[m], "nccl", P, P, o.comm_ctas, 2 * H, series));
    }
  }
  doc["rows"] = rows;
  if (!json_path.empty()) std::ofstream(json_path) << doc.dump(2) << '\n';
  return 0;
}

}  // namespace
}  // namespace pounce::bench

int main(int argc, char** argv) {
  return pounce::bench::guarded_main("pounce_dispatch_bench", pounce::bench::run, argc, argv);
}
