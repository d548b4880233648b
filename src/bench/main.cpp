// pounce_bench: the MoE layer benchmark. On a GPU it measures the chip's ceilings (cuBLAS dense GEMMs,
// HBM copy) and every MoE forward implementation on the catalogue shapes in one process, prints a
// comparison table and writes JSON. Without a GPU it says so and runs the host reference instead.
#include <cublasLt.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "baseline/cublas_moe.h"
#include "bench/dense_ceiling.h"
#include "bench/device_fill.h"
#include "bench/json.h"
#include "bench/shapes.h"
#include "common/error.h"
#include "common/gpu.h"
#include "reference/moe_layer.h"
#include "reference/moe_layer_ep.h"
#include "reference/synthetic_routing.h"

namespace pounce::bench {
namespace {

struct Options {
  std::string shapes = default_shape().name;
  std::string routing = "uniform";
  std::string json_path;
  std::string commit;
  int warmup = 5;
  int reps = 20;
  bool ceilings = true;
};

void usage() {
  std::printf(
      "usage: pounce_bench [--shapes NAMES|all] [--routing uniform|zipf|one_expert|half_empty]\n"
      "                    [--warmup N] [--reps N] [--json PATH] [--commit HASH] [--no-ceilings]\n"
      "shapes:");
  for (const auto& s : shape_catalogue()) std::printf(" %s", s.name.c_str());
  std::printf("\n");
}

Options parse(int argc, char** argv) {
  Options o;
  if (const char* c = std::getenv("POUNCE_COMMIT")) o.commit = c;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      POUNCE_REQUIRE(i + 1 < argc, "option ", arg, " needs a value");
      return argv[++i];
    };
    if (arg == "--shapes") o.shapes = value();
    else if (arg == "--routing") o.routing = value();
    else if (arg == "--json") o.json_path = value();
    else if (arg == "--commit") o.commit = value();
    else if (arg == "--warmup") o.warmup = std::stoi(value());
    else if (arg == "--reps") o.reps = std::stoi(value());
    else if (arg == "--no-ceilings") o.ceilings = false;
    else if (arg == "--help" || arg == "-h") { usage(); std::exit(0); }
    else POUNCE_FAIL("unknown option '", arg, "' (see --help)");
  }
  POUNCE_REQUIRE(o.reps >= 1 && o.warmup >= 0, "--reps must be >= 1 and --warmup >= 0");
  return o;
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
  planner::EpConfig config{.ranks = P, .experts = int(shape.experts), .topk = int(shape.topk), .hidden = shape.hidden,
                           .intermediate = shape.intermediate, .max_tokens_per_rank = shape.tokens / P};
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
  std::printf("  backward %8.1f ms (host)                        ||dx|| = %.6f\n", ms(t1, t2),
              std::sqrt([&] { double s = 0; for (double v : g.dx) s += v * v; return s; }()));
  std::printf("  expert-parallel split over %d ranks: max |difference| to one rank = %.3g\n", P, max_diff);
  return max_diff < 1e-9 ? 0 : 1;
}

// ---- GPU --------------------------------------------------------------------------------------------

Json environment(const Options& o) {
  const GpuInfo& gpu = gpu_info();
  int driver = 0, runtime = 0, nccl = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  ncclGetVersion(&nccl);
  Json env = Json::object();
  env["gpu"] = gpu.name;
  env["sm"] = std::to_string(gpu.sm_major) + "." + std::to_string(gpu.sm_minor);
  env["multiprocessors"] = gpu.multiprocessors;
  env["l2_bytes"] = gpu.l2_bytes;
  env["memory_bytes"] = gpu.global_memory_bytes;
  env["cuda_driver"] = driver;
  env["cuda_runtime"] = runtime;
  env["cublaslt"] = int64_t(cublasLtGetVersion());
  env["nccl_runtime"] = nccl;
  env["nccl_headers"] = NCCL_VERSION_CODE;
  env["git_commit"] = o.commit.empty() ? "unknown" : o.commit;
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  env["date"] = date;
  std::printf("GPU %s (sm_%d%d, %d SMs), CUDA driver %d runtime %d, cuBLASLt %ld, NCCL runtime %d headers %d, commit %s\n",
              gpu.name.c_str(), gpu.sm_major, gpu.sm_minor, gpu.multiprocessors, driver, runtime,
              long(cublasLtGetVersion()), nccl, NCCL_VERSION_CODE, o.commit.empty() ? "unknown" : o.commit.c_str());
  if (nccl != NCCL_VERSION_CODE)
    std::printf("WARNING: NCCL runtime %d differs from the headers built against (%d)\n", nccl, NCCL_VERSION_CODE);
  return env;
}

Json timing_json(const Timing& t) {
  Json j = Json::object();
  j["median_ms"] = t.median_ms;
  j["p10_ms"] = t.p10_ms;
  j["p90_ms"] = t.p90_ms;
  j["min_ms"] = t.min_ms;
  j["reps"] = t.reps;
  return j;
}

struct Row {
  std::string shape, impl;
  double ms, tflops, fraction_of_dense, speedup;
};

void print_table(const std::vector<Row>& rows) {
  std::printf("\n%-18s %-24s %10s %9s %9s %9s\n", "shape", "implementation", "ms", "TFLOP/s", "of dense", "speedup");
  for (const Row& r : rows)
    std::printf("%-18s %-24s %10.3f %9.1f %8.1f%% %8.2fx\n", r.shape.c_str(), r.impl.c_str(), r.ms, r.tflops,
                100 * r.fraction_of_dense, r.speedup);
  std::printf("(speedup: against the slowest implementation of the same shape; of dense: cuBLAS 8192^3 BF16 rate of this run)\n");
}

Json run_moe_shape(const MoeModelShape& s, const Options& o, double dense_tflops, std::vector<Row>& table,
                   cudaStream_t stream) {
  const int64_t T = s.slice_tokens, H = s.hidden, I = s.intermediate, E = s.slice_experts, k = s.topk;
  std::printf("\n%s: H %ld, I %ld, %ld local experts, %ld tokens, top-%ld, %s routing\n", s.name.c_str(), long(H),
              long(I), long(E), long(T), long(k), o.routing.c_str());
  std::mt19937_64 rng(42);  // benchmarks are reproducible; tests draw fresh inputs
  const auto pattern = reference::parse_routing_pattern(o.routing);
  const auto ids = reference::synthetic_topk_ids(pattern, T, int(E), int(k), rng);
  const auto weights = reference::synthetic_topk_weights(T, int(k), rng);

  // Two input sets, rotated between repetitions. Weights (>= 100 MB per shape) dwarf the L2 already.
  constexpr int kSets = 2;
  DeviceBuffer<__nv_bfloat16> w13(E * 2 * I * H), w2(E * H * I), y(T * H);
  std::vector<DeviceBuffer<__nv_bfloat16>> x;
  const float w_scale = 1.0f / std::sqrt(float(H));
  fill_random_bf16(w13.data(), w13.size(), 11, w_scale, stream);
  fill_random_bf16(w2.data(), w2.size(), 12, w_scale, stream);
  for (int i = 0; i < kSets; ++i) {
    x.emplace_back(T * H);
    fill_random_bf16(x.back().data(), T * H, 100 + i, 1.0f, stream);
  }
  DeviceBuffer<float> d_weights(weights);

  baseline::CublasMoe moe({.max_tokens = T, .hidden = H, .intermediate = I, .experts = E, .topk = k});
  moe.set_weights(w13.data(), w2.data());
  moe.set_routing(ids, T);

  Json result = Json::object();
  result["shape"] = s.name;
  result["hidden"] = H;
  result["intermediate"] = I;
  result["model_experts"] = s.model_experts;
  result["local_experts"] = E;
  result["tokens"] = T;
  result["topk"] = k;
  result["routing"] = o.routing;
  result["routes"] = moe.routes();
  result["padded_rows"] = moe.padded_rows();
  result["forward_flops"] = s.forward_flops();
  Json impls = Json::array();

  std::vector<Row> rows;
  for (auto calls : {baseline::GemmCalls::kLoop, baseline::GemmCalls::kGroupedBatched}) {
    const Timing t = time_on_stream(
        [&](int rep) { moe.forward(x[rep % kSets].data(), d_weights.data(), y.data(), calls, stream); }, stream,
        o.warmup, o.reps);
    const double tflops = s.forward_flops() / (t.median_ms * 1e-3) / 1e12;
    rows.push_back({s.name, std::string("forward ") + baseline::gemm_calls_name(calls), t.median_ms, tflops,
                    tflops / dense_tflops, 0});
    Json j = Json::object();
    j["impl"] = rows.back().impl;
    j["timing"] = timing_json(t);
    j["tflops"] = tflops;
    j["fraction_of_dense_bf16"] = tflops / dense_tflops;
    impls.push_back(j);
  }
  double slowest = 0;
  for (const Row& r : rows) slowest = std::max(slowest, r.ms);
  for (Row& r : rows) {
    r.speedup = slowest / r.ms;
    table.push_back(r);
  }
  result["implementations"] = impls;
  return result;
}

int run_gpu(const Options& o) {
  Json doc = Json::object();
  doc["environment"] = environment(o);
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));

  double dense_bf16 = 0;
  if (o.ceilings) {
    const Measured bf16 = dense_bf16_gemm(8192, o.warmup, o.reps, stream);
    const Measured fp8 = dense_fp8_gemm(8192, false, o.warmup, o.reps, stream);
    const Measured fp8_fast = dense_fp8_gemm(8192, true, o.warmup, o.reps, stream);
    const Measured copy = hbm_copy(int64_t(4) << 30, o.warmup, o.reps, stream);
    dense_bf16 = bf16.rate;
    std::printf("\nceilings: cuBLAS 8192^3 BF16 %.1f TFLOP/s (%.3f ms), FP8 %.1f (fast accumulation %.1f), "
                "HBM copy %.0f GB/s\n", bf16.rate, bf16.timing.median_ms, fp8.rate, fp8_fast.rate, copy.rate);
    Json c = Json::object();
    c["dense_bf16_8192_tflops"] = bf16.rate;
    c["dense_bf16_8192_timing"] = timing_json(bf16.timing);
    c["dense_fp8_8192_tflops"] = fp8.rate;
    c["dense_fp8_fast_accum_8192_tflops"] = fp8_fast.rate;
    c["hbm_copy_4GiB_gbps"] = copy.rate;
    doc["ceilings"] = c;
  }

  std::vector<Row> table;
  Json shapes = Json::array();
  for (const MoeModelShape& s : select_shapes(o.shapes)) shapes.push_back(run_moe_shape(s, o, dense_bf16, table, stream));
  doc["moe_forward"] = shapes;
  print_table(table);
  CUDA_CHECK(cudaStreamDestroy(stream));

  if (!o.json_path.empty()) {
    std::ofstream(o.json_path) << doc.dump();
    std::printf("results written to %s\n", o.json_path.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace pounce::bench

int main(int argc, char** argv) {
  using namespace pounce;
  try {
    const bench::Options options = bench::parse(argc, argv);
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
