#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <tuple>

#include "common/require.h"
#include "common/testing.h"
#include "planner/schedule.h"
#include "planner/wave_model.h"
#include "reference/synthetic_routing.h"

namespace pounce::planner {
namespace {

using reference::RoutingPattern;
using ::testing::HasSubstr;

EpConfig small_config(int ranks, int experts, int topk, int64_t max_tokens) {
  EpConfig c;
  c.ranks = ranks;
  c.experts = experts;
  c.topk = topk;
  c.hidden = 256;
  c.intermediate = 128;
  c.max_tokens_per_rank = max_tokens;
  return c;
}

using testing::error_message;

TEST(WaveModel, ReproducesPublishedMinibatch) {
  // 148 compute SMs, 128x256 tiles, intermediate 2048: the published 2368 rows.
  WaveModel m{.compute_sms = 148, .block_m = 128, .block_n = 256, .waves = 2};
  EXPECT_EQ(min_minibatch_rows(m, 2048), 2368);
  EXPECT_EQ(minibatch_rows_for(m, 2048), 2432);  // 19 whole m-blocks
}

TEST(WaveModel, ScalesWithSmsWavesAndTiles) {
  WaveModel m{.compute_sms = 132, .block_m = 128, .block_n = 256, .waves = 2};
  EXPECT_EQ(min_minibatch_rows(m, 2048), 2112);  // 2*132*128/16
  EXPECT_EQ(min_minibatch_rows(m, 768), 5632);   // 6 tiles per row block: fewer tiles, more rows
  m.waves = 3;
  EXPECT_EQ(min_minibatch_rows(m, 2048), 3168);
  m.block_n = 128;
  EXPECT_EQ(min_minibatch_rows(m, 2048), 1584);
}

TEST(WaveModel, RejectsBadArguments) {
  WaveModel m{.compute_sms = 0};
  EXPECT_THAT(error_message([&] { min_minibatch_rows(m, 2048); }), HasSubstr("compute_sms = 0"));
  m.compute_sms = 100;
  EXPECT_THAT(error_message([&] { min_minibatch_rows(m, 0); }), HasSubstr("intermediate = 0"));
}

TEST(WaveModel, CountsAPartialLastTile) {
  // Intermediate 320: GEMM1's N = 640 is 2.5 tiles of 256, so 3 tiles per row block.
  WaveModel m{.compute_sms = 132, .block_m = 128, .block_n = 256, .waves = 2};
  EXPECT_EQ(min_minibatch_rows(m, 320), 11264);  // 2*132*128/3
  EXPECT_EQ(minibatch_rows_for(m, 320), 11264);  // 88 m-blocks
}

TEST(Config, RejectsByName) {
  EXPECT_THAT(error_message([] { validate_config(small_config(3, 16, 2, 8)); }),
              HasSubstr("not divisible by ranks = 3"));
  EXPECT_THAT(error_message([] { validate_config(small_config(2, 16, 17, 8)); }), HasSubstr("topk = 17"));
  auto c = small_config(2, 16, 2, 8);
  c.hidden = 100;
  EXPECT_THAT(error_message([&] { validate_config(c); }), HasSubstr("hidden = 100 is not supported"));
  c = small_config(2, 16, 2, 8);
  c.intermediate = 96;
  EXPECT_THAT(error_message([&] { validate_config(c); }), HasSubstr("intermediate = 96 is not supported"));
  EXPECT_NO_THROW(validate_config(small_config(8, 256, 8, 8192)));
}

// The fused layer's documented limits (README, include/pounce/config.h), each named when broken, and the
// largest config inside every limit accepted.
TEST(Config, FusedLayerLimitsAreNamed) {
  const auto rejects = [](EpConfig c, const std::string& needle) {
    EXPECT_THAT(error_message([&] { check_config(c); }), HasSubstr(needle));
  };
  const EpConfig ok = small_config(8, 8 * kMaxLocalExperts, 8, 4096);
  EXPECT_NO_THROW(check_config(ok));
  auto c = ok;
  c.ranks = 9, c.experts = 9 * 16;
  rejects(c, "ranks = 9 is not supported: 1 to 8 ranks");
  c = ok, c.ranks = 0;
  rejects(c, "ranks = 0 is not supported");
  c = ok, c.experts = 8 * (kMaxLocalExperts + 1);
  rejects(c, "1025 experts per rank (experts = 8200 over ranks = 8) is above the limit of 1024");
  c = ok, c.experts = 12;
  rejects(c, "experts = 12 is not divisible by ranks = 8");
  c = ok, c.topk = 0;
  rejects(c, "topk = 0 must lie in [1, experts");
  c = ok, c.hidden = kMaxHidden + 64;
  rejects(c, "hidden = 65600 is above the limit of 65536");
  c = ok, c.hidden = 7000;
  rejects(c, "hidden = 7000 is not supported: it must be a positive multiple of 64");
  c = ok, c.intermediate = kMaxHidden + 64;
  rejects(c, "intermediate = 65600 is above the limit of 65536");
  c = ok, c.intermediate = 0;
  rejects(c, "intermediate = 0 is not supported");
  c = ok, c.max_tokens_per_rank = kMaxTokensPerRank + 1;
  rejects(c, "max_tokens_per_rank = 16777216 is above the limit of 16777215");
  c = ok, c.max_tokens_per_rank = -1;
  rejects(c, "max_tokens_per_rank = -1 is negative");
  // Inside every limit but more routed rows than int32 row indices hold: 8 ranks x 2^24 tokens x top-32.
  c = small_config(8, 8 * 64, 32, kMaxTokensPerRank);
  rejects(c, "do not fit int32 row indices");
}

TEST(Routing, RejectsByName) {
  auto c = small_config(2, 16, 2, 4);
  std::vector<int32_t> ids = {0, 1, 2, 16};
  EXPECT_THAT(error_message([&] { validate_routing(c, 1, ids, 2); }),
              HasSubstr("rank 1: topk_ids[token 1][k 1] = 16 is out of range [0, 16)"));
  ids = {0, 1, -1, 3};
  EXPECT_THAT(error_message([&] { validate_routing(c, 0, ids, 2); }), HasSubstr("topk_ids[token 1][k 0] = -1"));
  ids = {0, 1, 5, 5};
  EXPECT_THAT(error_message([&] { validate_routing(c, 0, ids, 2); }), HasSubstr("token 1 lists expert 5 twice"));
  ids.assign(10, 0);
  EXPECT_THAT(error_message([&] { validate_routing(c, 0, ids, 5); }), HasSubstr("has 5 tokens"));
  ids = {0, 1, 2};
  EXPECT_THAT(error_message([&] { validate_routing(c, 0, ids, 2); }), HasSubstr("3 entries, expected"));
}

// The schedule by brute force: gather every (local expert, source, token, k) tuple and sort them.
void expect_schedule_matches_brute_force(const EpConfig& c, int rank, const std::vector<std::vector<int32_t>>& ids,
                                         const std::vector<int64_t>& tokens, const RankSchedule& s,
                                         int64_t minibatch_rows) {
  std::vector<std::tuple<int, int, int, int>> routes;
  const int first = c.first_local_expert(rank);
  for (int src = 0; src < c.ranks; ++src)
    for (int64_t t = 0; t < tokens[src]; ++t)
      for (int k = 0; k < c.topk; ++k) {
        int e = ids[src][t * c.topk + k];
        if (e >= first && e < first + c.local_experts()) routes.emplace_back(e - first, src, int(t), k);
      }
  std::sort(routes.begin(), routes.end());
  ASSERT_EQ(s.routes(), int64_t(routes.size()));
  ASSERT_EQ(int(s.expert_offsets.size()), c.local_experts() + 1);
  EXPECT_EQ(s.expert_offsets[0], 0);

  size_t next = 0;
  for (int e = 0; e < c.local_experts(); ++e) {
    const int begin = s.expert_offsets[e], end = s.expert_offsets[e + 1];
    EXPECT_EQ(begin % kBlockM, 0) << "expert " << e << " does not start on an m-block";
    EXPECT_EQ(end - begin, (s.expert_routes[e] + kBlockM - 1) / kBlockM * kBlockM) << "expert " << e;
    for (int row = begin; row < end; ++row) {
      if (row - begin < s.expert_routes[e]) {
        ASSERT_LT(next, routes.size());
        auto [re, rs, rt, rk] = routes[next++];
        ASSERT_EQ(re, e) << "row " << row;
        ASSERT_EQ(s.row_source_rank[row], rs) << "row " << row;
        ASSERT_EQ(s.row_token[row], rt) << "row " << row;
        ASSERT_EQ(s.row_k[row], rk) << "row " << row;
      } else {
        ASSERT_EQ(s.row_source_rank[row], -1) << "padding row " << row;
        ASSERT_EQ(s.row_token[row], -1) << "padding row " << row;
        ASSERT_EQ(s.row_k[row], -1) << "padding row " << row;
      }
    }
  }
  EXPECT_EQ(next, routes.size());

  const Capacity cap = row_capacity(c);
  EXPECT_LE(s.routes(), cap.max_routes);
  EXPECT_LE(s.padded_rows(), cap.max_padded_rows);

  // Minibatches tile the m-blocks in runs of ceil(minibatch_rows / 128).
  const int64_t per = (minibatch_rows + kBlockM - 1) / kBlockM;
  ASSERT_GE(s.minibatch_starts.size(), 1u);
  EXPECT_EQ(s.minibatch_starts.front(), 0);
  EXPECT_EQ(s.minibatch_starts.back(), s.m_blocks());
  for (size_t i = 0; i + 1 < s.minibatch_starts.size(); ++i) {
    const int64_t len = s.minibatch_starts[i + 1] - s.minibatch_starts[i];
    EXPECT_GT(len, 0);
    if (i + 2 < s.minibatch_starts.size())
      EXPECT_EQ(len, per);
    else
      EXPECT_LE(len, per);
  }
}

struct ScheduleCase {
  int ranks;
  RoutingPattern pattern;
};

void PrintTo(const ScheduleCase& c, std::ostream* out) {
  *out << "P" << c.ranks << "_" << reference::routing_pattern_name(c.pattern);
}

class ScheduleTest : public ::testing::TestWithParam<ScheduleCase> {};

TEST_P(ScheduleTest, MatchesBruteForce) {
  auto rng = testing::fresh_rng();
  const auto [ranks, pattern] = GetParam();
  const int experts = 32, topk = 4;
  const int64_t max_tokens = 300;
  auto c = small_config(ranks, experts, topk, max_tokens);
  // Token counts differ per rank and include the edge cases 0 and 1.
  std::vector<int64_t> tokens(ranks);
  std::vector<std::vector<int32_t>> ids(ranks);
  std::uniform_int_distribution<int64_t> count(2, max_tokens);
  for (int r = 0; r < ranks; ++r) {
    tokens[r] = r == 1 ? 0 : r == 2 ? 1 : count(rng);
    ids[r] = reference::synthetic_topk_ids(pattern, tokens[r], experts, topk, rng);
  }
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
  for (int64_t minibatch_rows : {1, 128, 300, 2432}) {
    for (int rank = 0; rank < ranks; ++rank) {
      RankSchedule s = build_schedule(c, rank, views, tokens, minibatch_rows);
      EXPECT_EQ(s.rank, rank);
      expect_schedule_matches_brute_force(c, rank, ids, tokens, s, minibatch_rows);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RanksAndPatterns, ScheduleTest,
    ::testing::Values(ScheduleCase{1, RoutingPattern::kUniform}, ScheduleCase{2, RoutingPattern::kUniform},
                      ScheduleCase{4, RoutingPattern::kZipf}, ScheduleCase{8, RoutingPattern::kUniform},
                      ScheduleCase{8, RoutingPattern::kZipf}, ScheduleCase{4, RoutingPattern::kOneExpert},
                      ScheduleCase{2, RoutingPattern::kHalfEmpty}, ScheduleCase{4, RoutingPattern::kBalanced}));

TEST(Schedule, EveryRouteLandsOnExactlyOneRank) {
  auto rng = testing::fresh_rng();
  auto c = small_config(4, 16, 4, 200);
  std::vector<int64_t> tokens = {200, 7, 150, 1};
  std::vector<std::vector<int32_t>> ids;
  for (int64_t t : tokens) ids.push_back(reference::synthetic_topk_ids(RoutingPattern::kZipf, t, 16, 4, rng));
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
  std::vector<std::vector<int>> seen(4);
  for (int r = 0; r < 4; ++r) seen[r].assign(tokens[r] * 4, 0);
  for (int rank = 0; rank < 4; ++rank) {
    RankSchedule s = build_schedule(c, rank, views, tokens, 256);
    for (int64_t row = 0; row < s.padded_rows(); ++row)
      if (s.row_source_rank[row] >= 0) ++seen[s.row_source_rank[row]][s.row_token[row] * 4 + s.row_k[row]];
  }
  for (int r = 0; r < 4; ++r)
    for (size_t i = 0; i < seen[r].size(); ++i) ASSERT_EQ(seen[r][i], 1) << "rank " << r << " route " << i;
}

TEST(Schedule, EmptyEverywhere) {
  auto c = small_config(2, 8, 2, 16);
  std::vector<std::vector<int32_t>> ids(2);
  std::vector<int64_t> tokens = {0, 0};
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
  RankSchedule s = build_schedule(c, 1, views, tokens, 2432);
  EXPECT_EQ(s.padded_rows(), 0);
  EXPECT_EQ(s.minibatches(), 0);
  EXPECT_EQ(s.minibatch_starts, std::vector<int32_t>{0});
  EXPECT_EQ(s.expert_offsets, std::vector<int32_t>(5, 0));
}

TEST(Capacity, BoundIsTightForTheWorstRouting) {
  // Worst case: every rank sends every token to k local experts of rank 0, spread so that as many
  // experts as possible end one row past an m-block boundary.
  auto c = small_config(2, 16, 2, 129 * 4);  // 8 local experts, topk 2
  const Capacity cap = row_capacity(c);
  EXPECT_EQ(cap.max_routes, 2 * 516 * 2);
  std::vector<std::vector<int32_t>> ids(2);
  std::vector<int64_t> tokens = {516, 516};
  for (int r = 0; r < 2; ++r)
    for (int64_t t = 0; t < 516; ++t) {
      // 2064 routes over 8 experts: 258 each -> 3 m-blocks each = 3072 rows.
      int e = int((t * 2) % 8);
      ids[r].push_back(e);
      ids[r].push_back(e + 1);
    }
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
  RankSchedule s = build_schedule(c, 0, views, tokens, 128);
  EXPECT_EQ(s.padded_rows(), 3072);
  EXPECT_LE(s.padded_rows(), cap.max_padded_rows);
  EXPECT_EQ(cap.max_padded_rows, (2064 + 8 * 127) / 128 * 128);  // = 3072: the bound is reached
  // Ranks that own no routed expert receive nothing.
  EXPECT_EQ(build_schedule(c, 1, views, tokens, 128).padded_rows(), 0);
}

TEST(Capacity, NeverExceededOnRandomAdversarialRoutings) {
  auto rng = testing::fresh_rng();
  for (int trial = 0; trial < 50; ++trial) {
    std::uniform_int_distribution<int> pick_ranks(0, 3);
    const int ranks = 1 << pick_ranks(rng);
    const int local = std::uniform_int_distribution<int>(1, 6)(rng);
    const int experts = ranks * local;
    const int topk = std::uniform_int_distribution<int>(1, experts)(rng);
    auto c = small_config(ranks, experts, topk, std::uniform_int_distribution<int>(0, 140)(rng));
    std::vector<std::vector<int32_t>> ids(ranks);
    std::vector<int64_t> tokens(ranks, c.max_tokens_per_rank);
    for (int r = 0; r < ranks; ++r)
      ids[r] = reference::synthetic_topk_ids(RoutingPattern::kOneExpert, tokens[r], experts, topk, rng);
    std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
    const Capacity cap = row_capacity(c);
    for (int rank = 0; rank < ranks; ++rank) {
      RankSchedule s = build_schedule(c, rank, views, tokens, 512);
      ASSERT_LE(s.routes(), cap.max_routes);
      ASSERT_LE(s.padded_rows(), cap.max_padded_rows);
    }
  }
}

// max_routes_per_rank bounds the routes of one rank, and the rows with them (each busy expert adds at
// most 127 padding rows); above the worst case it changes nothing, and negative is named.
TEST(Capacity, MaxRoutesPerRankBoundsTheRows) {
  auto c = small_config(4, 32, 8, 1000);  // 8 local experts; worst case 4 * 1000 * 8 routes
  const Capacity worst = row_capacity(c);
  EXPECT_EQ(worst.max_routes, 32000);
  EXPECT_FALSE(worst.bounded);
  c.max_routes_per_rank = 9001;
  const Capacity cap = row_capacity(c);
  EXPECT_EQ(cap.max_routes, 9001);
  EXPECT_TRUE(cap.bounded);
  EXPECT_EQ(cap.max_padded_rows, (9001 + 8 * 127) / 128 * 128);
  EXPECT_EQ(cap.max_m_blocks, cap.max_padded_rows / 128);
  EXPECT_THAT(describe_capacity(c), HasSubstr("9001 routes per rank (max_routes_per_rank)"));
  c.max_routes_per_rank = 40000;
  EXPECT_EQ(row_capacity(c).max_routes, worst.max_routes);
  EXPECT_FALSE(row_capacity(c).bounded);
  c.max_routes_per_rank = -1;
  EXPECT_THAT(error_message([&] { row_capacity(c); }), HasSubstr("max_routes_per_rank = -1 is negative"));
}

// A routing that sends any rank more routes than the capacity is refused by name by the host planner
// for every rank (the device planners stop every rank too); at the capacity exactly it plans.
TEST(Capacity, RoutingPastMaxRoutesPerRankIsNamed) {
  auto rng = testing::fresh_rng();
  auto c = small_config(3, 12, 2, 50);
  std::vector<std::vector<int32_t>> ids(3);
  std::vector<int64_t> tokens = {50, 37, 11};
  for (int r = 0; r < 3; ++r)
    ids[r] = reference::synthetic_topk_ids(RoutingPattern::kUniform, tokens[r], c.experts, c.topk, rng);
  std::vector<int64_t> routes(3, 0);
  for (const auto& rank_ids : ids)
    for (int32_t id : rank_ids) ++routes[id / c.local_experts()];
  const int busiest = int(std::max_element(routes.begin(), routes.end()) - routes.begin());
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
  c.max_routes_per_rank = routes[busiest];
  for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(build_schedule(c, rank, views, tokens, 128).routes(), routes[rank]);
  c.max_routes_per_rank = routes[busiest] - 1;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_THAT(error_message([&] { build_schedule(c, rank, views, tokens, 128); }),
                HasSubstr("sends rank " + std::to_string(busiest) + " " + std::to_string(routes[busiest]) +
                          " routes, more than the " + std::to_string(routes[busiest] - 1)));
  }
}

TEST(Schedule, RejectsInvalidInputBeforeBuilding) {
  auto c = small_config(2, 8, 2, 4);
  std::vector<std::vector<int32_t>> ids = {{0, 1}, {3, 3}};
  std::vector<int64_t> tokens = {1, 1};
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());
  EXPECT_THAT(error_message([&] { build_schedule(c, 0, views, tokens, 128); }),
              HasSubstr("rank 1: token 0 lists expert 3 twice"));
  ids[1] = {3, 4};
  views.assign(ids.begin(), ids.end());
  EXPECT_THAT(error_message([&] { build_schedule(c, 2, views, tokens, 128); }), HasSubstr("rank = 2 is outside"));
  EXPECT_THAT(error_message([&] { build_schedule(c, 0, views, tokens, 0); }), HasSubstr("minibatch_rows = 0"));
}

}  // namespace
}  // namespace pounce::planner
