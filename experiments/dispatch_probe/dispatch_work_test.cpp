// The dispatch probe's work lists (moe/dispatch_work.h), on the host: carrying out every item of every
// rank, in either mode, must write each routed row of each destination's first R m-blocks exactly once,
// to the right ring row, and nothing else; push items hold one source's rows and come b first, then d;
// the per-m-block row counts are what push's readiness counters must reach.
#include "dispatch_probe/dispatch_work.h"

#include <gtest/gtest.h>

#include <map>

#include "common/testing.h"
#include "reference/synthetic_routing.h"

namespace pounce::moe {
namespace {

using reference::RoutingPattern;

struct Case {
  int ranks;
  int64_t tokens;  // rank r gets tokens + 3 r
  int experts, topk;
  RoutingPattern pattern;
  int64_t ring_blocks;  // 0: every m-block of the largest schedule
};

// (source, token) encoded in one number; -1 for a ring row nobody writes.
int64_t key(int32_t source, int32_t token) { return int64_t(source) << 32 | uint32_t(token); }

void check_case(const Case& c, std::mt19937_64& rng) {
  SCOPED_TRACE("P " + std::to_string(c.ranks) + ", " + reference::routing_pattern_name(c.pattern) + ", ring " +
               std::to_string(c.ring_blocks));
  const EpConfig config{.ranks = c.ranks,
                        .experts = c.experts,
                        .topk = c.topk,
                        .hidden = 64,
                        .intermediate = 64,
                        .max_tokens_per_rank = c.tokens + 3 * c.ranks};
  std::vector<std::vector<int32_t>> ids;
  for (int r = 0; r < c.ranks; ++r)
    ids.push_back(reference::synthetic_topk_ids(c.pattern, c.tokens + 3 * r, c.experts, c.topk, rng));
  const auto schedules = dispatch_schedules(config, ids);
  int64_t ring_blocks = 1;
  for (const auto& s : schedules) ring_blocks = std::max(ring_blocks, s.m_blocks());
  if (c.ring_blocks > 0) ring_blocks = c.ring_blocks;

  // What every ring must hold, and the rows per m-block.
  const int P = c.ranks;
  std::vector<std::vector<int64_t>> want(P, std::vector<int64_t>(ring_blocks * kBlockM, -1));
  std::vector<std::vector<uint32_t>> block_rows(P);
  for (int d = 0; d < P; ++d) {
    const auto& s = schedules[d];
    for (int64_t b = 0; b < std::min(ring_blocks, s.m_blocks()); ++b) {
      block_rows[d].push_back(0);
      for (int64_t row = b * kBlockM; row < (b + 1) * kBlockM; ++row)
        if (s.row_source_rank[row] >= 0) {
          want[d][row] = key(s.row_source_rank[row], s.row_token[row]);
          ++block_rows[d][b];
        }
    }
  }

  std::vector<RankDispatchPlan> plans;
  for (int r = 0; r < P; ++r) plans.push_back(plan_dispatch(schedules, r, ring_blocks));
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(plans[r].block_rows, block_rows[r]) << "rank " << r;
    int64_t rows = 0, remote = 0;
    for (int64_t k : want[r]) rows += k >= 0, remote += k >= 0 && int32_t(k >> 32) != r;
    EXPECT_EQ(plans[r].rows, rows) << "rank " << r;
    EXPECT_EQ(plans[r].remote_rows, remote) << "rank " << r;
  }

  for (DispatchMode mode : {DispatchMode::kPull, DispatchMode::kPush}) {
    SCOPED_TRACE(dispatch_mode_name(mode));
    std::vector<std::vector<int64_t>> got(P, std::vector<int64_t>(ring_blocks * kBlockM, -1));
    std::vector<std::map<int32_t, uint32_t>> arrived(P);  // [dest] m-block -> rows counted
    for (int mover = 0; mover < P; ++mover) {
      const DispatchWork& w = plans[mover].moves[int(mode)];
      std::pair<int32_t, int32_t> previous{-1, -1};  // (block, dest)
      for (const DispatchItem& item : w.items) {
        ASSERT_TRUE(item.rows >= 1 && item.rows <= kBlockM);
        ASSERT_LE(int64_t(item.first_row) + item.rows, int64_t(w.rows.size()));
        ASSERT_TRUE(item.dest >= 0 && item.dest < P);
        if (mode == DispatchMode::kPull) {
          EXPECT_EQ(item.dest, mover);
        }
        const std::pair<int32_t, int32_t> order{item.block, item.dest};
        EXPECT_LT(previous, order) << "items out of order";
        previous = order;
        arrived[item.dest][item.block] += uint32_t(item.rows);
        for (int32_t i = item.first_row; i < item.first_row + item.rows; ++i) {
          const DispatchRow& row = w.rows[i];
          if (mode == DispatchMode::kPush) {
            EXPECT_EQ(row.source, mover);
          }
          ASSERT_EQ(row.ring_row / kBlockM, item.block);
          EXPECT_EQ(got[item.dest][row.ring_row], -1) << "ring row " << row.ring_row << " written twice";
          got[item.dest][row.ring_row] = key(row.source, row.token);
        }
      }
    }
    for (int d = 0; d < P; ++d) {
      EXPECT_EQ(got[d], want[d]) << "rank " << d;
      for (size_t b = 0; b < block_rows[d].size(); ++b) {
        // pull: one item per m-block carrying all of its rows; push: the sources' items add up to them
        EXPECT_EQ(arrived[d][int32_t(b)], block_rows[d][b]) << "rank " << d << ", m-block " << b;
      }
    }
  }
}

TEST(DispatchWork, EveryItemInEitherModeWritesEachRoutedRowOnceToItsRingRow) {
  auto rng = testing::fresh_rng();
  const Case cases[] = {{1, 300, 8, 2, RoutingPattern::kUniform, 0},    {1, 1000, 16, 4, RoutingPattern::kZipf, 3},
                        {2, 0, 8, 2, RoutingPattern::kUniform, 0},      {2, 501, 8, 4, RoutingPattern::kOneExpert, 0},
                        {3, 400, 12, 3, RoutingPattern::kHalfEmpty, 2}, {4, 999, 32, 8, RoutingPattern::kZipf, 0},
                        {8, 257, 64, 8, RoutingPattern::kUniform, 5},   {8, 1000, 256, 8, RoutingPattern::kUniform, 0}};
  for (const Case& c : cases) check_case(c, rng);
}

}  // namespace
}  // namespace pounce::moe
