// Shared pieces of the benchmark binary: options, result rows, and the per-shape benchmarks.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "bench/json.h"
#include "bench/shapes.h"
#include "bench/timing.h"

namespace pounce::bench {

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
Json timing_json(const Timing& t);

// Times every MoE forward implementation (and, with options.gemms, each GEMM alone) at one shape;
// appends table rows and returns the shape's JSON.
Json bench_shape(const MoeModelShape& shape, const Options& options, double dense_bf16_tflops, std::vector<Row>& table,
                 cudaStream_t stream);

}  // namespace pounce::bench
