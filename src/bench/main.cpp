// pounce_bench: the MoE layer benchmark. On a GPU it measures the chip's ceilings (cuBLAS dense GEMMs,
// HBM copy) and every MoE forward implementation on the catalogue shapes in one process, prints a
// comparison table and writes JSON. Without a GPU it says so and runs the host reference instead.
#include <cublasLt.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench/bench.h"
#include "bench/cli.h"
#include "bench/dense_ceiling.h"
#include "comm/nccl_window.h"
#include "common/cuda_check.h"
#include "common/gpu.h"
#include "common/require.h"
#include "reference/moe_layer.h"
#include "reference/moe_layer_ep.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {
namespace {

// The command line, into `o`: option names and defaults are what scripts/gpu_check.sh passes.
void add_options(CLI::App& app, Options& o) {
  o.shapes = default_shape().name;
  std::string names;
  for (const std::string& n : shape_names()) names += " " + n;
  app.option_defaults()->always_capture_default();
  app.add_option("--shapes", o.shapes, "catalogue shapes, comma-separated, or all; shapes:" + names)->check(kShapeList);
  app.add_option("--routing", o.routing, "synthetic routing pattern")->check(CLI::IsMember(routing_names()));
  app.add_option("--warmup", o.warmup, "untimed runs of every candidate before timing")->check(at_least(0));
  app.add_option("--reps", o.reps, "timed runs of every candidate (the median is reported)")->check(at_least(1));
  app.add_option("--json", o.json_path, "write the results to this file");
  app.add_option("--commit", o.commit, "git commit recorded with the results")->envname("POUNCE_COMMIT");
  app.add_flag_callback(
      "--no-gemms", [&o] { o.gemms = false; }, "skip timing each grouped GEMM alone");
  app.add_flag_callback(
      "--no-backward", [&o] { o.backward = false; }, "skip the backward");
  app.add_option("--timeline", o.timeline_dir,
                 "folder for in-kernel timelines (a POUNCE_TIMELINE build): a forward's and a training step's "
                 "Chrome traces per shape, and what recording costs the forward");
  app.add_flag("--sweeps", o.sweeps,
               "fused layer sweeps: comm CTAs, minibatch and the fused backward's comm CTAs and minibatch at "
               "every shape; engine rows, ring and virtual ranks at the default shape");
}

// ---- no GPU: the host reference at a small shape ---------------------------------------------------

int run_host_reference() {
  const reference::MoeShape shape{.tokens = 256, .hidden = 256, .intermediate = 128, .experts = 8, .topk = 2};
  std::printf("Running the host reference MoE layer instead (T %ld, H %ld, I %ld, E %ld, top-%ld):\n",
              long(shape.tokens), long(shape.hidden), long(shape.intermediate), long(shape.experts), long(shape.topk));
  std::mt19937_64 rng(7);
  auto uniform = [&](size_t n, float scale) {
    std::uniform_real_distribution<float> d(-scale, scale);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  };
  const auto x = uniform(shape.tokens * shape.hidden, 1.0f);
  const auto dy = uniform(shape.tokens * shape.hidden, 1.0f);
  const auto w13 = uniform(shape.experts * 2 * shape.intermediate * shape.hidden, 0.06f);
  const auto w2 = uniform(shape.experts * shape.hidden * shape.intermediate, 0.06f);
  const auto ids = reference::synthetic_topk_ids(reference::RoutingPattern::kZipf, shape.tokens, int(shape.experts),
                                                 int(shape.topk), rng);
  const auto w = reference::synthetic_topk_weights(shape.tokens, int(shape.topk), rng);
  const reference::MoeInputs in{x, ids, w, w13, w2};

  auto t0 = std::chrono::steady_clock::now();
  const auto y = reference::moe_forward(shape, in);
  auto t1 = std::chrono::steady_clock::now();
  const auto g = reference::moe_backward(shape, in, dy);
  auto t2 = std::chrono::steady_clock::now();

  // The same layer split over 4 expert-parallel ranks must agree.
  const int P = 4;
  EpConfig config{.ranks = P,
                  .experts = int(shape.experts),
                  .topk = int(shape.topk),
                  .hidden = shape.hidden,
                  .intermediate = shape.intermediate,
                  .max_tokens_per_rank = shape.tokens / P};
  std::vector<reference::EpRankInputs> ranks(P);
  const int64_t per = shape.tokens / P, H = shape.hidden, k = shape.topk;
  for (int r = 0; r < P; ++r)
    ranks[r] = {per, std::span(x).subspan(r * per * H, per * H), std::span(ids).subspan(r * per * k, per * k),
                std::span(w).subspan(r * per * k, per * k), std::span(dy).subspan(r * per * H, per * H)};
  const auto ep = reference::moe_layer_ep(config, ranks, w13, w2, true);
  double max_diff = 0, y_norm = 0;
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < per * H; ++i) {
      max_diff = std::max(max_diff, std::abs(ep[r].y[i] - y[r * per * H + i]));
      max_diff = std::max(max_diff, std::abs(ep[r].dx[i] - g.dx[r * per * H + i]));
    }
  for (double v : y) y_norm += v * v;

  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  std::printf("  forward  %8.1f ms (host, double accumulation)   ||y|| = %.6f\n", ms(t0, t1), std::sqrt(y_norm));
  std::printf("  backward %8.1f ms (host)                        ||dx|| = %.6f\n", ms(t1, t2), std::sqrt([&] {
                double s = 0;
                for (double v : g.dx) s += v * v;
                return s;
              }()));
  std::printf("  expert-parallel split over %d ranks: max |difference| to one rank = %.3g\n", P, max_diff);
  return max_diff < 1e-9 ? 0 : 1;
}

// ---- GPU --------------------------------------------------------------------------------------------

Json environment(const Options& o) {
  const GpuInfo& gpu = gpu_info();
  int driver = 0, runtime = 0, nccl = 0;
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  NCCL_CHECK(ncclGetVersion(&nccl));
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const Json env = {{"gpu", gpu.name},
                    {"sm", std::to_string(gpu.sm_major) + "." + std::to_string(gpu.sm_minor)},
                    {"multiprocessors", gpu.multiprocessors},
                    {"l2_bytes", gpu.l2_bytes},
                    {"memory_bytes", gpu.global_memory_bytes},
                    {"cuda_driver", driver},
                    {"cuda_runtime", runtime},
                    {"cublaslt", cublasLtGetVersion()},
                    {"nccl_runtime", nccl},
                    {"nccl_headers", NCCL_VERSION_CODE},
                    {"git_commit", o.commit.empty() ? "unknown" : o.commit},
                    {"date", date}};
  std::printf(
      "GPU %s (sm_%d%d, %d SMs), CUDA driver %d runtime %d, cuBLASLt %ld, NCCL runtime %d headers %d, commit %s\n",
      gpu.name.c_str(), gpu.sm_major, gpu.sm_minor, gpu.multiprocessors, driver, runtime, long(cublasLtGetVersion()),
      nccl, NCCL_VERSION_CODE, o.commit.empty() ? "unknown" : o.commit.c_str());
  if (nccl != NCCL_VERSION_CODE)
    std::printf("WARNING: NCCL runtime %d differs from the headers built against (%d)\n", nccl, NCCL_VERSION_CODE);
  return env;
}

int run_gpu(const Options& o) {
  Json doc = {{"environment", environment(o)}};
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));

  // Ceilings first, in the same process as everything compared with them.
  const Measured bf16 = dense_bf16_gemm(8192, o.warmup, o.reps, stream);
  const Measured fp8 = dense_fp8_gemm(8192, false, o.warmup, o.reps, stream);
  const Measured fp8_fast = dense_fp8_gemm(8192, true, o.warmup, o.reps, stream);
  const Measured copy = hbm_copy(int64_t(4) << 30, o.warmup, o.reps, stream);
  std::printf(
      "\nceilings: cuBLAS 8192^3 BF16 %.1f TFLOP/s (%.3f ms), FP8 %.1f (fast accumulation %.1f), "
      "HBM copy %.0f GB/s\n",
      bf16.rate, bf16.timing.median_ms, fp8.rate, fp8_fast.rate, copy.rate);
  doc["ceilings"] = {{"dense_bf16_8192_tflops", bf16.rate},
                     {"dense_bf16_8192_timing", bf16.timing},
                     {"dense_fp8_8192_tflops", fp8.rate},
                     {"dense_fp8_fast_accum_8192_tflops", fp8_fast.rate},
                     {"hbm_copy_4GiB_gbps", copy.rate}};

  Report report;
  Json shapes = Json::array();
  for (const MoeModelShape& s : select_shapes(o.shapes)) shapes.push_back(bench_shape(s, o, bf16.rate, report, stream));
  doc["shapes"] = shapes;
  doc["check_tolerances"] = {{"relative_l2", kMaxRelativeL2}, {"worst_token", kMaxWorstToken}};
  doc["check_failures"] = report.failures;
  print_table(report.table);
  CUDA_CHECK(cudaStreamDestroy(stream));

  if (!o.json_path.empty()) {
    std::ofstream(o.json_path) << doc.dump(2) << '\n';
    std::printf("results written to %s\n", o.json_path.c_str());
  }
  if (report.failures.empty()) return 0;
  std::fflush(stdout);
  std::fprintf(stderr, "\n*** %zu OUTPUT CHECK(S) FAILED: these timings are of wrong results ***\n",
               report.failures.size());
  for (const std::string& f : report.failures) std::fprintf(stderr, "  %s\n", f.c_str());
  return 1;
}

}  // namespace

void print_table(const std::vector<Row>& rows) {
  std::printf("\n%-18s %-14s %-31s %9s %9s %9s %8s %10s %6s\n", "shape", "what", "implementation", "ms", "TFLOP/s",
              "of dense", "speedup", "vs unfused", "check");
  auto ratio = [](double r) {
    char s[16] = "-";
    if (r > 0) std::snprintf(s, sizeof s, "%.2fx", r);
    return std::string(s);
  };
  for (const Row& r : rows)
    std::printf("%-18s %-14s %-31s %9.3f %9.1f %8.1f%% %8s %10s %6s\n", r.shape.c_str(), r.what.c_str(), r.impl.c_str(),
                r.ms, r.tflops, 100 * r.fraction_of_dense, ratio(r.speedup).c_str(), ratio(r.vs_unfused).c_str(),
                r.check.c_str());
  std::printf(
      "(of dense: share of the cuBLAS 8192^3 BF16 rate measured at the start of this run; the \"cublas dense\"\n"
      " rows time it again interleaved with each comparison; repetitions of one step's candidates are\n"
      " interleaved. speedup: the fastest baseline's median over this row's, baselines being the cuBLAS\n"
      " chains of the same shape and step (so the best of them shows 1.00x, the other its time relative to it);\n"
      " for pounce_fused and the fused sweep settings, the fastest of those and pounce_unfused; reference\n"
      " rows (dense GEMM, GEMMs alone) have none. vs unfused: pounce_unfused's median over the fused row's.\n"
      " check: the output of the first run and of the last timed run against the cuBLAS grouped-batched\n"
      " chain's (limits: relative L2 %.0e, worst token or row %.0e). cuBLAS GEMM1 writes gate/up without SwiGLU)\n",
      kMaxRelativeL2, kMaxWorstToken);
}

}  // namespace pounce::bench

int main(int argc, char** argv) {
  using namespace pounce;
  bench::Options options;
  CLI::App app("pounce_bench: the MoE layer benchmark (without a GPU: the host reference)");
  bench::add_options(app, options);
  CLI11_PARSE(app, argc, argv);
  try {
    if (!gpu_info().present) {
      std::printf("No CUDA GPU here (%s): the GPU benchmark cannot run.\n", gpu_info().why_absent.c_str());
      return bench::run_host_reference();
    }
    return bench::run_gpu(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pounce_bench: error: %s\n", e.what());
    return 1;
  }
}
