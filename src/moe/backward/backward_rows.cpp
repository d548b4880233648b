#include "moe/backward/backward_rows.h"

#include <map>
#include <tuple>

#include "common/cuda_check.h"

namespace pounce::moe {

int64_t BackwardRowBuffers::bytes() const {
  int64_t bytes = 0;
  for (size_t b : {x_rows.bytes(),
                   h13.bytes(),
                   dy_rows.bytes(),
                   da.bytes(),
                   dgu.bytes(),
                   wa.bytes(),
                   dx_rows.bytes(),
                   row_weight.bytes(),
                   route_dot.bytes(),
                   dy_fp8.bytes(),
                   dgu_fp8.bytes(),
                   dy_scale.bytes(),
                   dgu_scale.bytes(),
                   dy_t.bytes(),
                   wa_t.bytes(),
                   dgu_t.bytes(),
                   x_t.bytes(),
                   fused.dy_rows.bytes(),
                   fused.da.bytes(),
                   fused.dgu.bytes(),
                   fused.wa.bytes(),
                   fused.dx_rows.bytes(),
                   fused.x_rows.bytes(),
                   fused.segment_dots.bytes(),
                   fused.row_weight.bytes()})
    bytes += int64_t(b);
  return bytes;
}

std::shared_ptr<SharedBackwardRows> SharedBackwardRows::of(const EpConfig& config, int launch_ranks) {
  // Everything the buffers' sizes follow from, and the GPU they live on.
  using Key = std::tuple<int, int, int, int, int64_t, int64_t, int64_t, int>;
  static std::mutex registry_mutex;
  static std::map<Key, std::weak_ptr<SharedBackwardRows>> registry;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const Key key{device,
                config.ranks,
                config.experts,
                config.topk,
                config.hidden,
                config.intermediate,
                config.max_tokens_per_rank,
                launch_ranks};
  std::lock_guard lock(registry_mutex);
  std::erase_if(registry, [](const auto& entry) { return entry.second.expired(); });
  if (std::shared_ptr<SharedBackwardRows> rows = registry[key].lock()) return rows;
  std::shared_ptr<SharedBackwardRows> rows(new SharedBackwardRows());
  CUDA_CHECK(cudaEventCreateWithFlags(&rows->done_, cudaEventDisableTiming));
  registry[key] = rows;
  return rows;
}

SharedBackwardRows::~SharedBackwardRows() {
  if (done_) cudaEventDestroy(done_);  // no throw from a destructor
}

int64_t SharedBackwardRows::bytes() const {
  std::lock_guard lock(mutex_);
  return buffers_.bytes();
}

SharedBackwardRows::Use::Use(SharedBackwardRows& rows, cudaStream_t stream)
    : rows_(rows), lock_(rows.mutex_), stream_(stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  capturing_ = capture != cudaStreamCaptureStatusNone;
  if (!capturing_ && rows_.used_) CUDA_CHECK(cudaStreamWaitEvent(stream, rows_.done_, 0));
}

SharedBackwardRows::Use::~Use() {
  if (capturing_) return;
  // No throw from a destructor: a failed record leaves the next use unordered, and the error, sticky or
  // not, surfaces at the caller's next CUDA call.
  if (cudaEventRecord(rows_.done_, stream_) == cudaSuccess) rows_.used_ = true;
}

}  // namespace pounce::moe
