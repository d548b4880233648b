#include "reference/synthetic_routing.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

namespace pounce::reference {
namespace {

struct PatternCase {
  RoutingPattern pattern;
  int64_t tokens;
  int experts, topk;
};

class SyntheticRouting : public ::testing::TestWithParam<PatternCase> {};

// Every pattern: ids in range, k distinct experts per token, and the load shape it promises.
TEST_P(SyntheticRouting, ValidAndShapedAsNamed) {
  const PatternCase c = GetParam();
  std::mt19937_64 rng(11 + c.tokens);
  const std::vector<int32_t> ids = synthetic_topk_ids(c.pattern, c.tokens, c.experts, c.topk, rng);
  ASSERT_EQ(int64_t(ids.size()), c.tokens * c.topk);
  std::vector<int64_t> load(c.experts, 0);
  for (int64_t t = 0; t < c.tokens; ++t) {
    const std::set<int32_t> distinct(ids.begin() + t * c.topk, ids.begin() + (t + 1) * c.topk);
    ASSERT_EQ(int(distinct.size()), c.topk) << "token " << t;
    for (const int32_t e : distinct) {
      ASSERT_TRUE(e >= 0 && e < c.experts) << "token " << t << " expert " << e;
      ++load[e];
    }
  }
  const auto [least, most] = std::minmax_element(load.begin(), load.end());
  const int64_t routes = c.tokens * c.topk;
  switch (c.pattern) {
    case RoutingPattern::kBalanced:
      EXPECT_EQ(*least, routes / c.experts);
      EXPECT_EQ(*most, (routes + c.experts - 1) / c.experts);
      break;
    case RoutingPattern::kHalfEmpty:
      EXPECT_EQ(std::count(load.begin(), load.end(), 0), c.experts - c.experts / 2);
      break;
    case RoutingPattern::kOneExpert:
      EXPECT_EQ(*most, c.tokens);
      for (int64_t t = 1; t < c.tokens; ++t) ASSERT_EQ(ids[t * c.topk], ids[0]);
      break;
    case RoutingPattern::kZipf:
      // The hottest expert draws several times its uniform share at these sizes.
      EXPECT_GT(*most, 3 * routes / c.experts);
      break;
    case RoutingPattern::kUniform:
      EXPECT_LT(*most, 2 * routes / c.experts);
      break;
  }
}

// The names the benchmark's --routing takes round-trip.
TEST(SyntheticRoutingNames, RoundTrip) {
  for (const RoutingPattern p : {RoutingPattern::kUniform, RoutingPattern::kZipf, RoutingPattern::kOneExpert,
                                 RoutingPattern::kHalfEmpty, RoutingPattern::kBalanced})
    EXPECT_EQ(parse_routing_pattern(routing_pattern_name(p)), p);
  EXPECT_ANY_THROW(parse_routing_pattern("even"));
}

INSTANTIATE_TEST_SUITE_P(Patterns, SyntheticRouting,
                         ::testing::Values(PatternCase{RoutingPattern::kUniform, 4096, 32, 8},
                                           PatternCase{RoutingPattern::kZipf, 4096, 64, 6},
                                           PatternCase{RoutingPattern::kOneExpert, 301, 16, 4},
                                           PatternCase{RoutingPattern::kHalfEmpty, 257, 10, 3},
                                           PatternCase{RoutingPattern::kBalanced, 8192, 32, 8},
                                           PatternCase{RoutingPattern::kBalanced, 333, 7, 7},
                                           PatternCase{RoutingPattern::kBalanced, 1, 128, 1},
                                           PatternCase{RoutingPattern::kBalanced, 0, 4, 2}));

}  // namespace
}  // namespace pounce::reference
