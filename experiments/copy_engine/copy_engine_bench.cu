// pounce_copy_bench: how fast one communication CTA moves rows (moe/row_mover.cuh), by how many rows of
// each item the bulk-copy engine takes and by row length. Every CTA takes items of 128 rows from a ticket,
// as the fused kernel's comm CTAs do, and copies each row from a random source row to its place in a
// contiguous destination; the destination is checked afterwards.
//
// usage: pounce_copy_bench [--json PATH]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/guarded_main.h"
#include "bench/timing.h"
#include "common/cuda_check.h"
#include "common/device_buffer.h"
#include "common/gpu.h"
#include "moe/row_mover.cuh"

namespace pounce::moe {
namespace {

constexpr int kThreads = 384;  // the fused kernel's CTA

struct CopyJob {
  const uint8_t* src;
  const int32_t* src_row;  // [rows] source row of each destination row
  uint8_t* dst;
  int64_t rows;
  uint32_t row_bytes;
  int engine_rows;
  uint32_t* ticket;
};

struct BenchShared {
  CopyEngine::Shared engine;
  const void* src[kBlockM];
  void* dst[kBlockM];
  int64_t item;
};

__global__ void __launch_bounds__(kThreads) copy_kernel(CopyJob job, DeviceErrorSink sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  auto& s = *reinterpret_cast<BenchShared*>(smem);
  CopyEngine engine(s.engine, WaitSite{sink, DeviceRole::kDispatch, 2'000'000'000ull, 0});
  const int64_t items = (job.rows + kBlockM - 1) / kBlockM;
  for (;;) {
    if (threadIdx.x == 0) s.item = atomicAdd(job.ticket, 1u);
    __syncthreads();  // also: the engine's barriers are initialized, the last item's table is used up
    const int64_t i = s.item;
    if (i >= items) break;
    if (threadIdx.x < kBlockM) {
      const int64_t row = i * kBlockM + threadIdx.x;
      s.src[threadIdx.x] = row < job.rows ? job.src + int64_t(job.src_row[row]) * job.row_bytes : nullptr;
      s.dst[threadIdx.x] = job.dst + row * job.row_bytes;
    }
    __syncthreads();
    move_rows<kThreads>(engine, s.src, s.dst, job.row_bytes, job.engine_rows);
  }
}

int run(int argc, char** argv) {
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else POUNCE_FAIL("unknown option '", arg, "' (usage: pounce_copy_bench [--json PATH])");
  }
  const int sms = gpu_info().multiprocessors;
  const int64_t tokens = 8192, rows = 8192 * 8;
  const uint32_t max_row_bytes = 7168 * 2;
  std::mt19937_64 rng(7);
  std::vector<int32_t> src_row(rows);
  for (auto& r : src_row) r = int32_t(rng() % tokens);
  std::vector<uint8_t> src_host(tokens * max_row_bytes);
  for (auto& b : src_host) b = uint8_t(rng());
  DeviceBuffer<uint8_t> src(src_host), dst(rows * max_row_bytes);
  DeviceBuffer<int32_t> d_src_row(src_row);
  DeviceBuffer<uint32_t> ticket(1);
  DeviceErrorSlot errors;
  const int smem = int(sizeof(BenchShared));
  CUDA_CHECK(cudaFuncSetAttribute(copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));

  std::FILE* json = json_path.empty() ? nullptr : std::fopen(json_path.c_str(), "w");
  if (json) std::fprintf(json, "{\"gpu\": \"%s\", \"commit\": \"%s\", \"rows\": %ld, \"runs\": [\n",
                         gpu_info().name.c_str(), std::getenv("POUNCE_COMMIT") ? std::getenv("POUNCE_COMMIT") : "unknown",
                         long(rows));
  std::printf("%11s %9s %5s %10s %12s %14s\n", "engine rows", "row bytes", "CTAs", "ms", "GB/s", "GB/s per CTA");
  bool first_run = true;
  for (const uint32_t row_bytes : {4096u, 8192u, 14336u})
    for (const int ctas : {1, 12, sms})
      for (const int engine_rows : {128, 0, 16, 32, 48, 64, 80}) {
        const int64_t n = ctas == 1 ? rows / 8 : rows;  // one CTA: fewer rows, same per-CTA rate
        const CopyJob job{src.data(), d_src_row.data(), dst.data(), n, row_bytes, engine_rows, ticket.data()};
        auto launch = [&](int) {
          CUDA_CHECK(cudaMemsetAsync(ticket.data(), 0, sizeof(uint32_t), stream));
          copy_kernel<<<ctas, kThreads, smem, stream>>>(job, errors.device_sink());
          CUDA_CHECK_LAUNCH();
        };
        CUDA_CHECK(cudaMemsetAsync(dst.data(), 0xFF, dst.size(), stream));
        const bench::Timing t = bench::time_on_stream(launch, stream, 2, 7);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        errors.check();
        // Every destination row must hold its source row.
        const std::vector<uint8_t> got = dst.download();
        for (int64_t r = 0; r < n; r += 997)
          POUNCE_REQUIRE(std::equal(got.begin() + r * row_bytes, got.begin() + (r + 1) * row_bytes,
                                    src_host.begin() + int64_t(src_row[r]) * row_bytes),
                         "engine rows ", engine_rows, ": destination row ", r, " differs from its source");
        const double gbps = double(n) * row_bytes / (t.median_ms * 1e-3) / 1e9;
        std::printf("%11d %9u %5d %10.3f %12.1f %14.1f\n", engine_rows, row_bytes, ctas, t.median_ms, gbps, gbps / ctas);
        if (json)
          std::fprintf(json, "%s  {\"engine_rows\": %d, \"row_bytes\": %u, \"ctas\": %d, \"median_ms\": %.4f, \"gbps\": %.2f}",
                       first_run ? "" : ",\n", engine_rows, row_bytes, ctas, t.median_ms, gbps);
        first_run = false;
      }
  if (json) std::fprintf(json, "\n]}\n"), std::fclose(json);
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace pounce::moe

int main(int argc, char** argv) { return pounce::bench::guarded_main("pounce_copy_bench", pounce::moe::run, argc, argv); }
