#include "moe/shared_rows.h"

#include <map>
#include <tuple>

#include "common/cuda_check.h"
#include "common/tiles.h"

namespace pounce::moe {

std::shared_ptr<SharedRows> SharedRows::of(const EpConfig& config, int launch_ranks, int64_t ring_blocks) {
  // Everything the buffers' sizes follow from, and the GPU they live on.
  using Key = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int, int64_t>;
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
                launch_ranks,
                ring_blocks};
  std::lock_guard lock(registry_mutex);
  std::erase_if(registry, [](const auto& entry) { return entry.second.expired(); });
  if (std::shared_ptr<SharedRows> rows = registry[key].lock()) return rows;
  std::shared_ptr<SharedRows> rows(new SharedRows());
  const int64_t ring_rows = launch_ranks * ring_blocks * kBlockM;
  rows->h_ring_ = DeviceBuffer<__nv_bfloat16>(ring_rows * config.intermediate);
  rows->out_ring_ = DeviceBuffer<__nv_bfloat16>(ring_rows * config.hidden);
  CUDA_CHECK(cudaEventCreateWithFlags(&rows->done_, cudaEventDisableTiming));
  registry[key] = rows;
  return rows;
}

SharedRows::~SharedRows() {
  if (done_) cudaEventDestroy(done_);  // no throw from a destructor
}

int64_t SharedRows::bytes() const {
  std::lock_guard lock(mutex_);
  return int64_t(h_ring_.bytes() + out_ring_.bytes()) + backward_.bytes();
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
