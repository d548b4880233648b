#include <algorithm>
#include <random>

#include "common/cuda_check.h"
#include "copy_engine/copy_engine_bench.h"
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

}  // namespace

RowCopyBench::RowCopyBench(int64_t sources, int64_t rows, uint32_t max_row_bytes)
    : max_row_bytes_(max_row_bytes), src_row_(rows), src_host_(sources * max_row_bytes) {
  std::mt19937_64 rng(7);
  for (auto& r : src_row_) r = int32_t(rng() % sources);
  for (auto& b : src_host_) b = uint8_t(rng());
  src_ = DeviceBuffer<uint8_t>(src_host_);
  dst_ = DeviceBuffer<uint8_t>(rows * max_row_bytes);
  d_src_row_ = DeviceBuffer<int32_t>(src_row_);
  ticket_ = DeviceBuffer<uint32_t>(1);
  CUDA_CHECK(cudaFuncSetAttribute(copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(BenchShared))));
  CUDA_CHECK(cudaStreamCreate(&stream_));
}

RowCopyBench::~RowCopyBench() {
  if (stream_) cudaStreamDestroy(stream_);  // no throw from a destructor
}

bench::Timing RowCopyBench::run(int64_t rows, uint32_t row_bytes, int ctas, int engine_rows, int warmup, int reps) {
  POUNCE_REQUIRE(rows <= int64_t(src_row_.size()) && row_bytes <= max_row_bytes_, "RowCopyBench: ", rows, " rows of ",
                 row_bytes, " bytes; at most ", src_row_.size(), " of ", max_row_bytes_);
  const CopyJob job{src_.data(), d_src_row_.data(), dst_.data(), rows, row_bytes, engine_rows, ticket_.data()};
  auto launch = [&](int) {
    CUDA_CHECK(cudaMemsetAsync(ticket_.data(), 0, sizeof(uint32_t), stream_));
    copy_kernel<<<ctas, kThreads, sizeof(BenchShared), stream_>>>(job, errors_.device_sink());
    CUDA_CHECK_LAUNCH();
  };
  CUDA_CHECK(cudaMemsetAsync(dst_.data(), 0xFF, dst_.size(), stream_));
  const bench::Timing t = bench::time_on_stream(launch, stream_, warmup, reps);
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  errors_.check();
  // Destination rows (every 997th) must hold their source rows.
  const std::vector<uint8_t> got = dst_.download();
  for (int64_t r = 0; r < rows; r += 997)
    POUNCE_REQUIRE(std::equal(got.begin() + r * row_bytes, got.begin() + (r + 1) * row_bytes,
                              src_host_.begin() + int64_t(src_row_[r]) * row_bytes),
                   "engine rows ", engine_rows, ": destination row ", r, " differs from its source");
  return t;
}

}  // namespace pounce::moe
