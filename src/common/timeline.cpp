#include "common/timeline.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include "common/cuda_check.h"
#include "common/require.h"

namespace pounce {

const char* timeline_span_name(TimelineSpan span) {
  switch (span) {
    case TimelineSpan::kPlan:
      return "plan";
    case TimelineSpan::kOpening:
      return "opening";
    case TimelineSpan::kDispatch:
      return "dispatch";
    case TimelineSpan::kCombine:
      return "combine";
    case TimelineSpan::kTileWait:
      return "tile wait";
    case TimelineSpan::kMainloop:
      return "mainloop";
    case TimelineSpan::kEpilogue:
      return "epilogue";
    case TimelineSpan::kSums:
      return "sums";
    case TimelineSpan::kElementwise:
      return "elementwise";
  }
  return "unknown";
}

bool timeline_compiled_in() {
#ifdef POUNCE_TIMELINE
  return true;
#else
  return false;
#endif
}

Timeline::Timeline(int64_t max_events) {
  POUNCE_REQUIRE(timeline_compiled_in(),
                 "timeline: this build records no timeline; configure with -DPOUNCE_TIMELINE=ON");
  POUNCE_REQUIRE(max_events > 0 && max_events <= UINT32_MAX, "timeline: max_events = ", max_events,
                 ", must be in [1, 2^32)");
  events_ = DeviceBuffer<TimelineEvent>(size_t(max_events));
  count_ = DeviceBuffer<uint32_t>(1);
  count_.fill_bytes(0);
}

TimelineSink Timeline::sink() { return {events_.data(), count_.data(), uint32_t(events_.size())}; }

void Timeline::clear(cudaStream_t stream) { CUDA_CHECK(cudaMemsetAsync(count_.data(), 0, sizeof(uint32_t), stream)); }

std::vector<TimelineEvent> Timeline::events() {
  CUDA_CHECK(cudaDeviceSynchronize());
  const uint32_t count = count_.download()[0];
  POUNCE_REQUIRE(count <= events_.size(), "timeline: ", count, " events recorded, the buffer holds ", events_.size(),
                 "; make it larger");
  std::vector<TimelineEvent> all = events_.download();
  all.resize(count);
  return all;
}

namespace {

std::string span_label(const TimelineEvent& e) {
  const auto span = TimelineSpan(e.span);
  std::string name = timeline_span_name(span);
  // GEMM spans name their GEMM (the fused forward: 1 = gate/up, 2 = down) so each gets its own colour; the
  // producer's wait for an elementwise item (TileInfo::gemm 2, gemm/gemm_pipeline.cuh) is its own kind.
  constexpr int32_t kElementwiseItem = 2;
  if (span == TimelineSpan::kTileWait && e.a == kElementwiseItem) return name + " item";
  if ((span == TimelineSpan::kMainloop || span == TimelineSpan::kEpilogue || span == TimelineSpan::kTileWait) &&
      e.a >= 0)
    name += " G" + std::to_string(e.a + 1);
  return name;
}

// A JSON string's contents: quotes, backslashes and control characters escaped.
std::string json_escaped(const std::string& text) {
  std::string out;
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char code[8];
      std::snprintf(code, sizeof(code), "\\u%04x", unsigned(c));
      out += code;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::string chrome_trace_json(const std::vector<TimelineEvent>& events, const std::vector<std::string>& kernel_names) {
  uint64_t origin = UINT64_MAX;
  for (const TimelineEvent& e : events) origin = std::min(origin, e.begin_ns);
  std::string out = "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[";
  char buffer[320];
  const char* separator = "\n";
  std::set<uint32_t> kernels;
  std::set<std::pair<uint32_t, uint32_t>> tracks;  // (kernel, CTA * 4 + warpgroup)
  for (const TimelineEvent& e : events) {
    const uint32_t track = e.block * 4 + e.warpgroup;
    kernels.insert(e.kernel);
    tracks.insert({e.kernel, track});
    std::snprintf(buffer, sizeof(buffer),
                  "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%u,\"tid\":%u,\"ts\":%.3f,\"dur\":%.3f,"
                  "\"args\":{\"sm\":%u,\"a\":%d,\"b\":%d,\"c\":%d,\"cycles\":%u}}",
                  separator, span_label(e).c_str(), unsigned(e.kernel), track, double(e.begin_ns - origin) / 1000.0,
                  double(e.end_ns - e.begin_ns) / 1000.0, e.sm, e.a, e.b, e.c, e.cycles);
    out += buffer;
    separator = ",\n";
  }
  for (uint32_t kernel : kernels) {
    const std::string name = kernel < kernel_names.size() ? kernel_names[kernel] : "kernel " + std::to_string(kernel);
    out += separator;
    out += "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" + std::to_string(kernel) + ",\"args\":{\"name\":\"" +
           json_escaped(name) + "\"}}";
    separator = ",\n";
  }
  for (const auto& [kernel, track] : tracks) {
    std::snprintf(
        buffer, sizeof(buffer),
        ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%u,\"tid\":%u,\"args\":{\"name\":\"CTA %u wg %u\"}}"
        ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%u,\"tid\":%u,\"args\":{\"sort_index\":%u}}",
        kernel, track, track / 4, track % 4, kernel, track, track);
    out += buffer;
  }
  out += "\n]}\n";
  return out;
}

}  // namespace pounce
