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
  bool gemms = true;         // also time each grouped GEMM alone
  bool backward = true;      // the backward: pounce's chain and each of its GEMMs
  bool sweeps = false;       // fused layer sweeps at the default shape: minibatch, comm CTAs, ring, virtual ranks
  std::string timeline_dir;  // a POUNCE_TIMELINE build: traces of a forward and a training step go here
};

// Tolerances of every output check against the reference chain (cuBLAS grouped-batched: bf16 GEMMs,
// fp32 accumulation). The implementations round the hidden activations and the expert outputs to bf16
// at different points, which alone gives ~3e-3 relative L2 (4.6e-3 measured on y); a lost route or a
// wrong tile is far above both. One token's error may be larger than the whole output's: its norm is
// smaller and its errors do not average out.
constexpr double kMaxRelativeL2 = 1e-2;
constexpr double kMaxWorstToken = 3e-2;
// The FP8 chain against the BF16 one: E4M3 keeps 3 fraction bits (each element off by up to 1/16), so
// its output differs by a few percent; the band catches a wrong scale or row, not the rounding.
constexpr double kFp8MaxRelativeL2 = 0.1;
constexpr double kFp8MaxWorstToken = 0.2;

// One line of the printed comparison table.
struct Row {
  std::string shape, what, impl;
  double ms = 0, tflops = 0, fraction_of_dense = 0;
  double speedup = 0;     // the fastest baseline's ms / ms (see compare()); 0: none
  double vs_unfused = 0;  // fused rows: pounce_unfused's ms / ms; 0: none
  std::string check;      // "ok", "FAILED", or "-" where nothing is checked
};

// What a run collects across shapes: the table, and every output check that failed (one line each).
struct Report {
  std::vector<Row> table;
  std::vector<std::string> failures;
};

void print_table(const std::vector<Row>& rows);

// nlohmann's hook for Timing (found by argument-dependent lookup: `j["timing"] = timing`).
inline void to_json(Json& j, const Timing& t) {
  j = {{"median_ms", t.median_ms}, {"p10_ms", t.p10_ms}, {"p90_ms", t.p90_ms}, {"min_ms", t.min_ms}, {"reps", t.reps}};
}

// Times every MoE forward implementation (and, with options.gemms, each GEMM alone) at one shape,
// checking every timed output against the reference chain; adds table rows and check failures to
// `report` and returns the shape's JSON.
Json bench_shape(const MoeModelShape& shape, const Options& options, double dense_bf16_tflops, Report& report,
                 cudaStream_t stream);

}  // namespace pounce::bench
