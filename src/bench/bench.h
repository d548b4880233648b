// Shared pieces of the benchmark binary: options, result rows, and the per-shape benchmarks.
#pragma once

#include <cuda_runtime.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/shapes.h"
#include "bench/timing.h"

namespace pounce::bench {

// Results keep their fields in the order written (summaries and diffs read better that way).
using Json = nlohmann::ordered_json;

struct Options {
  std::string shapes;
  std::string routing = "uniform";
  std::string json_path;
  std::string commit;
  int warmup = 5;
  int reps = 20;
  bool gemms = true;   // also time each grouped GEMM alone
  bool sweeps = false; // fused layer sweeps at the default shape: minibatch, comm CTAs, ring, virtual ranks
};

// One line of the printed comparison table.
struct Row {
  std::string shape, what, impl;
  double ms = 0, tflops = 0, fraction_of_dense = 0;
  double speedup = 0;  // against the slowest implementation of the same shape and `what`
};

void print_table(const std::vector<Row>& rows);

// nlohmann's hook for Timing (found by argument-dependent lookup: `j["timing"] = timing`).
inline void to_json(Json& j, const Timing& t) {
  j = {{"median_ms", t.median_ms}, {"p10_ms", t.p10_ms}, {"p90_ms", t.p90_ms}, {"min_ms", t.min_ms}, {"reps", t.reps}};
}

// Times every MoE forward implementation (and, with options.gemms, each GEMM alone) at one shape;
// appends table rows and returns the shape's JSON.
Json bench_shape(const MoeModelShape& shape, const Options& options, double dense_bf16_tflops, std::vector<Row>& table,
                 cudaStream_t stream);

}  // namespace pounce::bench
