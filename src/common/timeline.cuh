// Recording side of the in-kernel timeline (common/timeline.h). Every call compiles to nothing unless the
// build defines POUNCE_TIMELINE. Typical use, by one thread of a role:
//   const timeline::Stamp begin = timeline::now();  ... work ...  timeline::record(sink, TimelineSpan::kX, begin, m);
#pragma once

#include "common/timeline.h"
#include "ptx/ptx.cuh"

namespace pounce::timeline {

#ifdef POUNCE_TIMELINE
inline constexpr bool kEnabled = true;
#else
inline constexpr bool kEnabled = false;
#endif

// A point in time on both clocks: the global timer (ns, common to every SM) and the SM's cycle counter
// (so a span also says at which clock the SM ran).
struct Stamp {
  uint64_t ns = 0;
  uint64_t cycles = 0;
};

__device__ __forceinline__ Stamp now() {
  if constexpr (kEnabled) return {ptx::globaltimer_ns(), ptx::clock_cycles()};
  return {};
}

// Appends the span [begin, now] for the calling thread's CTA and warpgroup; nothing without a sink.
__device__ __forceinline__ void record(const TimelineSink& sink, TimelineSpan span, const Stamp& begin, int32_t a = -1,
                                       int32_t b = -1, int32_t c = -1) {
  if constexpr (kEnabled) {
    if (sink.events == nullptr) return;
    const Stamp end = now();
    const uint32_t i = atomicAdd(sink.count, 1u);
    if (i < sink.capacity)
      sink.events[i] = {begin.ns,
                        end.ns,
                        blockIdx.x,
                        ptx::smid(),
                        uint16_t(span),
                        uint8_t(threadIdx.x / 128),
                        sink.kernel,
                        a,
                        b,
                        c,
                        uint32_t(end.cycles - begin.cycles)};
  }
}

}  // namespace pounce::timeline
