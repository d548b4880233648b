#include "moe/shared_rows.h"

#include <map>
#include <tuple>

#include "common/cuda_check.h"
#include "common/tiles.h"
#include "planner/schedule.h"

namespace pounce::moe {

std::shared_ptr<SharedRows> SharedRows::of(const EpConfig& config, int launch_ranks) {
  // Everything the route rows' sizes follow from, and the GPU they live on.
  using Key = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int64_t, int>;
  static std::mutex registry_mutex;
  static std::map<Key, std::weak_ptr<SharedRows>> registry;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const Key key{device,
                config.ranks,
                config.experts,
                config.topk,
                config.hidden,
                config.intermediate,
                config.max_tokens_per_rank,
                planner::row_capacity(config).max_routes,
                launch_ranks};
  std::lock_guard lock(registry_mutex);
  std::erase_if(registry, [](const auto& entry) { return entry.second.expired(); });
  if (std::shared_ptr<SharedRows> rows = registry[key].lock()) return rows;
  std::shared_ptr<SharedRows> rows(new SharedRows(config, launch_ranks));
  CUDA_CHECK(cudaEventCreateWithFlags(&rows->done_, cudaEventDisableTiming));
  registry[key] = rows;
  return rows;
}

SharedRows::~SharedRows() {
  if (done_) cudaEventDestroy(done_);  // no throw from a destructor
}

const SharedRows::Rings& SharedRows::rings(int64_t ring_blocks) {
  std::lock_guard lock(mutex_);
  if (auto found = rings_.find(ring_blocks); found != rings_.end()) return found->second;
  Rings made;  // into the map only once all of it fits
  const int64_t ring_rows = launch_ranks_ * ring_blocks * kBlockM;
  made.h = DeviceBuffer<__nv_bfloat16>(ring_rows * config_.intermediate);
  made.out = DeviceBuffer<__nv_bfloat16>(ring_rows * config_.hidden);
  return rings_.emplace(ring_blocks, std::move(made)).first->second;
}

__nv_bfloat16* SharedRows::x_ring(int64_t ring_blocks) {
  rings(ring_blocks);
  std::lock_guard lock(mutex_);
  Rings& rings = rings_.at(ring_blocks);
  if (rings.x.size() == 0) {
    rings.x = DeviceBuffer<__nv_bfloat16>(launch_ranks_ * ring_blocks * kBlockM * config_.hidden);
    rings.x.fill_bytes(0);  // padding rows are read (stale) by GEMM1, whose rows of them nobody reads
  }
  return rings.x.data();
}

int64_t SharedRows::bytes() const {
  std::lock_guard lock(mutex_);
  int64_t bytes = backward_.bytes();
  for (const auto& [ring_blocks, rings] : rings_)
    bytes += int64_t(rings.h.bytes() + rings.out.bytes() + rings.x.bytes());
  return bytes;
}

SharedRows::Use::Use(SharedRows& rows, cudaStream_t stream) : rows_(rows), lock_(rows.mutex_), stream_(stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  capturing_ = capture != cudaStreamCaptureStatusNone;
  if (!capturing_ && rows_.used_) CUDA_CHECK(cudaStreamWaitEvent(stream, rows_.done_, 0));
}

SharedRows::Use::~Use() {
  if (capturing_) return;
  // No throw from a destructor: a failed record leaves the next use unordered, and the error, sticky or
  // not, surfaces at the caller's next CUDA call.
  if (cudaEventRecord(rows_.done_, stream_) == cudaSuccess) rows_.used_ = true;
}

}  // namespace pounce::moe
