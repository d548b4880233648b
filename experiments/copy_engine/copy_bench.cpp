// pounce_copy_bench: how fast one communication CTA moves rows (moe/row_mover.cuh), by how many rows of
// each item the bulk-copy engine takes and by row length (moe/copy_engine_bench.h runs the copies and
// checks the destination). JSON to --json; options: --help.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "bench/bench.h"
#include "bench/guarded_main.h"
#include "common/gpu.h"
#include "copy_engine/copy_engine_bench.h"

namespace pounce::bench {
namespace {

int run(int argc, char** argv) {
  std::string json_path;
  CLI::App app("pounce_copy_bench: GB/s of the communication CTAs' row movers, by engine rows and row length");
  app.add_option("--json", json_path, "write the results to this file");
  CLI11_PARSE(app, argc, argv);

  const int sms = gpu_info().multiprocessors;
  const int64_t tokens = 8192, rows = 8192 * 8;
  moe::RowCopyBench copies(tokens, rows, 7168 * 2);
  const char* commit = std::getenv("POUNCE_COMMIT");
  Json runs = Json::array();
  std::printf("%11s %9s %5s %10s %12s %14s\n", "engine rows", "row bytes", "CTAs", "ms", "GB/s", "GB/s per CTA");
  for (const uint32_t row_bytes : {4096u, 8192u, 14336u})
    for (const int ctas : {1, 12, sms})
      for (const int engine_rows : {128, 0, 16, 32, 48, 64, 80}) {
        const int64_t n = ctas == 1 ? rows / 8 : rows;  // one CTA: fewer rows, same per-CTA rate
        const Timing t = copies.run(n, row_bytes, ctas, engine_rows, 2, 7);
        const double gbps = double(n) * row_bytes / (t.median_ms * 1e-3) / 1e9;
        std::printf("%11d %9u %5d %10.3f %12.1f %14.1f\n", engine_rows, row_bytes, ctas, t.median_ms, gbps,
                    gbps / ctas);
        runs.push_back({{"engine_rows", engine_rows},
                        {"row_bytes", row_bytes},
                        {"ctas", ctas},
                        {"median_ms", t.median_ms},
                        {"gbps", gbps}});
      }
  const Json doc = {{"gpu", gpu_info().name}, {"commit", commit ? commit : "unknown"}, {"rows", rows}, {"runs", runs}};
  if (!json_path.empty()) std::ofstream(json_path) << doc.dump(2) << '\n';
  return 0;
}

}  // namespace
}  // namespace pounce::bench

int main(int argc, char** argv) {
  return pounce::bench::guarded_main("pounce_copy_bench", pounce::bench::run, argc, argv);
}
