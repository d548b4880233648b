#include "common/timeline.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/testing.h"

namespace pounce {
namespace {

using ::testing::HasSubstr;

// Two kernels' spans: times from the first span's start, in microseconds; a process per kernel tag,
// named from the list (or by number past its end); a track per CTA and warpgroup.
TEST(Timeline, ChromeTraceNamesKernelsTracksAndSpans) {
  const std::vector<TimelineEvent> events = {
      {5'000, 7'500, 3, 10, uint16_t(TimelineSpan::kMainloop), 2, 0, 1, 4, 7, 4'500},
      {4'000, 4'250, 0, 0, uint16_t(TimelineSpan::kPlan), 0, 0, -1, -1, -1, 400},
      {9'000, 9'500, 1, 1, uint16_t(TimelineSpan::kEpilogue), 1, 3, 0, 2, 0, 900},
  };
  const std::string trace = chrome_trace_json(events, {"fused forward"});
  EXPECT_THAT(trace, HasSubstr(R"("name":"mainloop G2","ph":"X","pid":0,"tid":14,"ts":1.000,"dur":2.500,)"
                               R"("args":{"sm":10,"a":1,"b":4,"c":7,"cycles":4500}})"));
  EXPECT_THAT(trace, HasSubstr(R"("name":"plan","ph":"X","pid":0,"tid":0,"ts":0.000,"dur":0.250)"));
  EXPECT_THAT(trace, HasSubstr(R"("name":"epilogue G1","ph":"X","pid":3,"tid":5,"ts":5.000,"dur":0.500)"));
  EXPECT_THAT(trace, HasSubstr(R"("name":"process_name","ph":"M","pid":0,"args":{"name":"fused forward"}})"));
  EXPECT_THAT(trace, HasSubstr(R"("name":"process_name","ph":"M","pid":3,"args":{"name":"kernel 3"}})"));
  EXPECT_THAT(trace, HasSubstr(R"("tid":14,"args":{"name":"CTA 3 wg 2"}})"));
  EXPECT_EQ(trace.front(), '{');
  EXPECT_EQ(trace.substr(trace.size() - 4), "\n]}\n");
  EXPECT_EQ(chrome_trace_json({}, {}), "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n]}\n");
  // Names are escaped, however long.
  const std::string name = std::string(400, 'x') + " \"quoted\" back\\slash";
  EXPECT_THAT(chrome_trace_json(events, {name}),
              HasSubstr(std::string(R"("args":{"name":")") + std::string(400, 'x') + R"( \"quoted\" back\\slash"}})"));
}

TEST(Timeline, RefusesToRecordInABuildWithoutIt) {
  if (timeline_compiled_in()) GTEST_SKIP() << "this build records timelines";
  testing::expect_error([] { Timeline timeline(16); }, "configure with -DPOUNCE_TIMELINE=ON");
}

}  // namespace
}  // namespace pounce
