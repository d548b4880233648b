// The in-kernel timeline: spans of what each CTA's roles did (planning, row moves, each GEMM tile's
// mainloop and epilogue, the sums), stamped with the GPU's global timer. Kernels record only in a build
// with the CMake option POUNCE_TIMELINE; otherwise the stamps compile to nothing (no cost at all) and
// a Timeline refuses to start.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/device_buffer.h"

namespace pounce {

enum class TimelineSpan : uint16_t {
  kPlan = 0,      // the planner's phase of a fused kernel, per CTA
  kOpening = 1,   // the first minibatch's rows, pulled by every CTA in pieces
  kDispatch = 2,  // one m-block pulled into the ring                               (a = m-block)
  kCombine = 3,   // one m-block pushed to its source ranks' slots                  (a = m-block)
  kTileWait = 4,  // a GEMM producer taking a tile and waiting for its inputs      (a = GEMM, b = m-block)
  kMainloop = 5,  // a consumer warpgroup's K slices of one tile                    (a = GEMM, b = m-block, c = n-block)
  kEpilogue = 6,  // its epilogue: registers to staging boxes to TMA stores        (a, b, c as for the mainloop)
  kSums = 7,      // the weighted sums of a CTA (or, in a backward, its token sums)
  kElementwise = 8,  // the fused backward: a consumer warpgroup's part of a SwiGLU-backward item (b, c: m-block, piece)
};
inline constexpr int kTimelineSpans = 9;

const char* timeline_span_name(TimelineSpan span);

struct TimelineEvent {
  uint64_t begin_ns, end_ns;  // %globaltimer
  uint32_t block, sm;
  uint16_t span;      // TimelineSpan
  uint8_t warpgroup;  // of the recording thread: 0 producer or communication, 1-2 GEMM consumers
  uint8_t kernel;     // TimelineSink::kernel of the launch
  int32_t a, b, c;    // what the span worked on (TimelineSpan says), -1 where unused
  uint32_t cycles;    // the SM's clock cycles over the span: with end_ns - begin_ns, its clock
};

// Where kernels append events: a device array and its counter (which keeps counting past the capacity,
// so the host can tell how many were lost), and a tag for the launch that records.
struct TimelineSink {
  TimelineEvent* events = nullptr;
  uint32_t* count = nullptr;
  uint32_t capacity = 0;
  uint8_t kernel = 0;  // which kernel records (its name: chrome_trace_json's kernel_names)
};

// True in a build with POUNCE_TIMELINE.
bool timeline_compiled_in();

// The device buffer kernels record into, and its conversion to a Chrome trace (chrome://tracing,
// ui.perfetto.dev): one track per CTA and warpgroup, times in microseconds from the first event.
class Timeline {
 public:
  // Throws pounce::Error in a build without POUNCE_TIMELINE.
  explicit Timeline(int64_t max_events);
  TimelineSink sink();
  void clear(cudaStream_t stream);
  // Synchronizes the device. Throws if events were lost (the buffer was too small), naming how many.
  std::vector<TimelineEvent> events();

 private:
  DeviceBuffer<TimelineEvent> events_;
  DeviceBuffer<uint32_t> count_;
};

// events as Chrome trace JSON: a process per kernel tag, named kernel_names[tag] (or "kernel <tag>"),
// a track per CTA and warpgroup.
std::string chrome_trace_json(const std::vector<TimelineEvent>& events, const std::vector<std::string>& kernel_names);

}  // namespace pounce
