// Recording side of the in-kernel timeline (common/timeline.h). Every call compiles to nothing unless the
// build defines POUNCE_TIMELINE. Typical use, by one thread of a role:
//   const uint64_t begin = timeline::now();  ... work ...  timeline::record(sink, TimelineSpan::kX, begin, m);
#pragma once

#include "common/timeline.h"
#include "ptx/ptx.cuh"

namespace pounce::timeline {

#ifdef POUNCE_TIMELINE
inline constexpr bool kEnabled = true;
#else
inline constexpr bool kEnabled = false;
#endif

__device__ __forceinline__ uint64_t now() {
  if constexpr (kEnabled) return ptx::globaltimer_ns();
  return 0;
}

// Appends the span [begin, now] for the calling thread's CTA and warpgroup; nothing without a sink.
__device__ __forceinline__ void record(const TimelineSink& sink, TimelineSpan span, uint64_t begin, int32_t a = -1,
                                       int32_t b = -1, int32_t c = -1) {
  if constexpr (kEnabled) {
    if (sink.events == nullptr) return;
    const uint64_t end = ptx::globaltimer_ns();
    const uint32_t i = atomicAdd(sink.count, 1u);
    if (i < sink.capacity)
      sink.events[i] = {begin, end,       blockIdx.x, ptx::smid(), uint16_t(span), uint8_t(threadIdx.x / 128),
                        sink.kernel, a, b, c};
  }
}

}  // namespace pounce::timeline
