// The fused kernel's work queues (moe/work_queues.h): the communication queue pulls each m-block in once
// and pushes it out once, refilling a ring slot only after its previous tenant left; the GEMM queue
// holds every tile once, in the minibatch order the argument needs; and a simulation of CTAs taking
// both queues in order, after the opening, never deadlocks when the ring holds two minibatches (and can
// when it holds one), nor in place (one rank, the ring holding every m-block, communication CTAs joining
// the GEMMs). Also how the backward's elementwise items cut their rows into stage-sized slices.
#include "moe/work_queues.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <set>
#include <tuple>
#include <vector>

namespace pounce::moe {
namespace {

TEST(CommQueue, EachMBlockOnceInOnceOutAndRingSlotsFreedBeforeReuse) {
  for (int32_t m_blocks : {0, 1, 2, 3, 7, 32, 33, 100})
    for (int32_t ring : {1, 2, 3, 8, 32, 64, 200}) {
      SCOPED_TRACE("M " + std::to_string(m_blocks) + ", R " + std::to_string(ring));
      std::vector<int64_t> pulled(m_blocks, -1), pushed(m_blocks, -1);
      for (int64_t i = 0; i < 2 * int64_t(m_blocks); ++i) {
        const CommItem item = comm_item(i, m_blocks, ring);
        ASSERT_GE(item.m_block, 0);
        ASSERT_LT(item.m_block, m_blocks);
        int64_t& at = item.combine ? pushed[item.m_block] : pulled[item.m_block];
        ASSERT_EQ(at, -1) << "m-block " << item.m_block << " twice as " << (item.combine ? "C" : "D");
        at = i;
      }
      for (int32_t b = 0; b < m_blocks; ++b) {
        ASSERT_GE(pulled[b], 0);
        ASSERT_GT(pushed[b], pulled[b]) << "C(" << b << ") before D(" << b << ")";
        if (b >= ring) {
          EXPECT_LT(pushed[b - ring], pulled[b]) << "D(" << b << ") refills the slot before C(" << b - ring << ")";
        }
        if (b + ring < m_blocks) {
          // Dispatch runs as far ahead as the ring allows: D(b + R) right after C(b).
          EXPECT_EQ(pulled[b + ring], pushed[b] + 1);
        }
      }
    }
}

// In place (one rank, the ring holds every m-block) the kernel takes only the first M items: they must be
// every dispatch, in m-block order, with nothing to wait for.
TEST(CommQueue, InPlaceTakesEveryDispatchInOrder) {
  for (int32_t m_blocks : {0, 1, 7, 100})
    for (int32_t extra : {0, 1, 50}) {
      const int32_t ring = m_blocks + extra;
      for (int64_t i = 0; i < m_blocks; ++i) {
        const CommItem item = comm_item(i, m_blocks, ring);
        EXPECT_FALSE(item.combine) << "item " << i << " of M " << m_blocks << ", R " << ring;
        EXPECT_EQ(item.m_block, i);
      }
    }
}

// A backward that pulls x rows again (every m-block has a ring slot): every D, X and C item once, the
// pulls (D, then X) ahead of every push, which alone waits (for the GEMMs). In place (one rank) the
// queue is its first 2M items: D and X only, nothing pushed.
TEST(CommQueue, BackwardPullsEveryDyAndXRowOnceBeforeAnyPush) {
  for (int32_t m_blocks : {0, 1, 2, 7, 100}) {
    SCOPED_TRACE("M " + std::to_string(m_blocks));
    std::vector<int64_t> pulled(m_blocks, -1), pulled_x(m_blocks, -1), pushed(m_blocks, -1);
    for (int64_t i = 0; i < 3 * int64_t(m_blocks); ++i) {
      const CommItem item = backward_comm_item(i, m_blocks);
      ASSERT_GE(item.m_block, 0);
      ASSERT_LT(item.m_block, m_blocks);
      ASSERT_FALSE(item.combine && item.x_rows);
      int64_t& at = item.combine ? pushed[item.m_block] : item.x_rows ? pulled_x[item.m_block] : pulled[item.m_block];
      ASSERT_EQ(at, -1) << "item " << i << " repeats m-block " << item.m_block;
      at = i;
    }
    for (int32_t b = 0; b < m_blocks; ++b) {
      EXPECT_EQ(pulled[b], b) << "D items first, in m-block order (the opening is the first of them)";
      EXPECT_GT(pulled_x[b], *std::max_element(pulled.begin(), pulled.end()));
      EXPECT_GT(pushed[b], *std::max_element(pulled_x.begin(), pulled_x.end()));
    }
    for (int64_t i = 0; i < 2 * int64_t(m_blocks); ++i)
      EXPECT_FALSE(backward_comm_item(i, m_blocks).combine) << "item " << i << " of an in-place queue";
    // Without X items the backward's queue (ring of every m-block) is the forward's: D(0..M-1), C(0..M-1).
    for (int64_t i = 0; i < 2 * int64_t(m_blocks); ++i) {
      const CommItem item = comm_item(i, m_blocks, m_blocks);
      EXPECT_EQ(item.combine, i >= m_blocks);
      EXPECT_EQ(item.m_block, i % std::max(m_blocks, 1));
    }
  }
}

// The opening (the first minibatch, pulled by every CTA before the queues start) is the queue's first
// items, all dispatches into slots with no earlier tenant: it waits for nothing.
TEST(CommQueue, OpeningIsTheFirstDispatchesAndWaitsForNothing) {
  for (int32_t m_blocks : {0, 1, 7, 100})
    for (int32_t bpm : {1, 3, 16, 200}) {
      const int32_t ring = std::min(m_blocks, 2 * bpm), opening = opening_blocks(m_blocks, bpm);
      EXPECT_EQ(opening, std::min(m_blocks, bpm));
      for (int64_t i = 0; i < opening; ++i) {
        const CommItem item = comm_item(i, m_blocks, ring);
        EXPECT_FALSE(item.combine);
        EXPECT_EQ(item.m_block, i);
        EXPECT_LT(item.m_block, ring) << "opening item " << i << " would wait for a ring slot";
      }
    }
}

TileQueue make_queue(int32_t m_blocks, int32_t bpm, int32_t n1, int32_t n2) {
  return {m_blocks, (m_blocks + bpm - 1) / bpm, bpm, {n1, n2}};
}

TEST(TileQueue, EveryTileOnceAndGemm2OfAMinibatchBetweenGemm1OfTheNextTwo) {
  for (int32_t m_blocks : {0, 1, 5, 16, 17, 64})
    for (int32_t bpm : {1, 2, 3, 16})
      for (auto [n1, n2] : {std::pair{1, 1}, {16, 28}, {3, 2}}) {
        SCOPED_TRACE("M " + std::to_string(m_blocks) + ", minibatch " + std::to_string(bpm) + ", n " +
                     std::to_string(n1) + "/" + std::to_string(n2));
        const TileQueue q = make_queue(m_blocks, bpm, n1, n2);
        std::vector<int64_t> at[2] = {std::vector<int64_t>(int64_t(m_blocks) * n1, -1),
                                      std::vector<int64_t>(int64_t(m_blocks) * n2, -1)};
        for (int64_t t = 0; t < q.tiles(); ++t) {
          GemmTile tile;
          ASSERT_TRUE(q.tile(t, tile));
          const int32_t n = tile.gemm == 0 ? n1 : n2;
          ASSERT_TRUE(tile.gemm == 0 || tile.gemm == 1);
          ASSERT_TRUE(tile.m_block >= 0 && tile.m_block < m_blocks && tile.n_block >= 0 && tile.n_block < n);
          int64_t& slot = at[tile.gemm][int64_t(tile.m_block) * n + tile.n_block];
          ASSERT_EQ(slot, -1) << "tile listed twice";
          slot = t;
        }
        GemmTile past;
        EXPECT_FALSE(q.tile(q.tiles(), past));
        auto last_of = [&](int gemm, int32_t minibatch) {
          int64_t last = -1;
          const int32_t n = gemm == 0 ? n1 : n2;
          for (int32_t b = minibatch * bpm; b < std::min(m_blocks, (minibatch + 1) * bpm); ++b)
            for (int32_t j = 0; j < n; ++j) last = std::max(last, at[gemm][int64_t(b) * n + j]);
          return last;
        };
        auto first_of = [&](int gemm, int32_t minibatch) {
          int64_t first = INT64_MAX;
          const int32_t n = gemm == 0 ? n1 : n2;
          for (int32_t b = minibatch * bpm; b < std::min(m_blocks, (minibatch + 1) * bpm); ++b)
            for (int32_t j = 0; j < n; ++j) first = std::min(first, at[gemm][int64_t(b) * n + j]);
          return first;
        };
        for (int32_t j = 0; j < q.minibatches; ++j) {
          EXPECT_LT(last_of(0, j), first_of(1, j)) << "GEMM2 of minibatch " << j << " before its GEMM1";
          if (j + 2 < q.minibatches) {
            EXPECT_LT(last_of(1, j), first_of(0, j + 2)) << "GEMM2 of minibatch " << j << " after GEMM1 of " << j + 2;
          }
        }
      }
}

// The backward's queue: every D1 and D2 tile and every S piece once; S(b) after every D1 tile of b, D2(b)
// after every S piece of b (so each wait points at earlier entries), and the first D2 tile of a
// minibatch only after every D1 tile of the next one (the lag that hides the S items).
TEST(ElementwiseTileQueue, ElementwiseItemsSitAMinibatchAheadOfTheTilesWaitingForThem) {
  for (int32_t m_blocks : {0, 1, 5, 17, 64})
    for (int32_t bpm : {1, 2, 3, 16})
      for (auto [n1, n2] : {std::pair{1, 1}, {8, 28}, {3, 2}})
        for (int32_t pieces : {1, 4}) {
          SCOPED_TRACE("M " + std::to_string(m_blocks) + ", minibatch " + std::to_string(bpm) + ", n " +
                       std::to_string(n1) + "/" + std::to_string(n2) + ", pieces " + std::to_string(pieces));
          const int32_t minibatches = (m_blocks + bpm - 1) / bpm;
          const ElementwiseTileQueue q{m_blocks, minibatches, bpm, {n1, n2}, pieces};
          ASSERT_EQ(q.tiles(), int64_t(m_blocks) * (n1 + n2 + pieces));
          std::vector<int64_t> last_d1(m_blocks, -1), last_s(m_blocks, -1), first_s(m_blocks, INT64_MAX),
              first_d2(m_blocks, INT64_MAX);
          std::set<std::tuple<int32_t, int32_t, int32_t>> seen;
          for (int64_t t = 0; t < q.tiles(); ++t) {
            GemmTile tile;
            ASSERT_TRUE(q.tile(t, tile)) << t;
            ASSERT_TRUE(tile.m_block >= 0 && tile.m_block < m_blocks);
            ASSERT_TRUE(seen.insert({tile.gemm, tile.m_block, tile.n_block}).second) << "listed twice";
            const int32_t n = tile.gemm == 0 ? n1 : tile.gemm == 1 ? n2 : pieces;
            ASSERT_TRUE(tile.n_block >= 0 && tile.n_block < n);
            if (tile.gemm == 0) last_d1[tile.m_block] = t;
            if (tile.gemm == kElementwiseItem)
              last_s[tile.m_block] = t, first_s[tile.m_block] = std::min(first_s[tile.m_block], t);
            if (tile.gemm == 1) first_d2[tile.m_block] = std::min(first_d2[tile.m_block], t);
          }
          GemmTile past;
          EXPECT_FALSE(q.tile(q.tiles(), past));
          for (int32_t b = 0; b < m_blocks; ++b) {
            EXPECT_LT(last_d1[b], first_s[b]) << "S of m-block " << b << " before one of its D1 tiles";
            EXPECT_LT(last_s[b], first_d2[b]) << "D2 of m-block " << b << " before one of its S pieces";
            const int32_t next = std::min(m_blocks, (b / bpm + 2) * bpm);  // past the next minibatch
            for (int32_t c = b / bpm * bpm + bpm; c < next; ++c)
              EXPECT_LT(last_d1[c], first_d2[b]) << "D2 of m-block " << b << " before D1 of m-block " << c;
          }
        }
}

// CTAs that take items in queue order and wait for each item's inputs, as the kernel's do. A GEMM CTA's
// producer takes its next tile once the current one's inputs are ready (its loads issued), holding at
// most two tiles; its consumers finish tiles in order. In place (ring = every m-block) the comm queue is
// the M dispatch items, and a comm CTA with nothing left to take becomes a GEMM CTA. Returns false on
// deadlock.
// With `pieces` > 0 the GEMM CTAs take the E4M3 forward's queue instead (ElementwiseTileQueue: `pieces`
// elementwise items per m-block between the two GEMMs, each waiting for GEMM1 of its m-block, GEMM2
// waiting for all of them).
// The fused backward adds, with `pull_x`, an X item per m-block to the communication queue
// (backward_comm_item: D, X, then C items; in place D and X only), and `w_tiles` weight-gradient tiles
// after the data path's, each waiting for every elementwise item and every X item (kItemsDone,
// kXRowsDone).
bool simulate(int32_t m_blocks, int32_t bpm, int32_t n1, int32_t n2, int32_t ring, int comm_ctas, int gemm_ctas,
              bool in_place = false, int32_t pieces = 0, bool pull_x = false, int64_t w_tiles = 0) {
  constexpr int32_t kWeightTile = kElementwiseItem + 1;  // the simulation's tag for a W tile
  const TileQueue plain = make_queue(m_blocks, bpm, n1, n2);
  const ElementwiseTileQueue with_items{m_blocks, plain.minibatches, bpm, {n1, n2}, pieces};
  const int64_t data_tiles = pieces > 0 ? with_items.tiles() : plain.tiles(), tiles = data_tiles + w_tiles;
  std::vector<char> pulled(m_blocks), pushed(m_blocks);
  std::vector<int32_t> gemm1_done(m_blocks), gemm2_done(m_blocks), items_done(m_blocks);
  int64_t all_items_done = 0, x_done = 0;
  // The opening: every CTA pulls the first minibatch before taking either queue.
  const int32_t opening = opening_blocks(m_blocks, bpm);
  for (int32_t b = 0; b < opening; ++b) pulled[b] = 1;
  int64_t next_item = opening, next_tile = 0, finished = opening;
  const int64_t items = ((in_place ? 1 : 2) + (pull_x ? 1 : 0)) * int64_t(m_blocks);
  const int64_t work = items + tiles;
  std::vector<int64_t> comm_holds(comm_ctas, -1);
  std::vector<char> joined(comm_ctas);  // in place: comm CTAs that became GEMM CTAs
  std::vector<std::deque<GemmTile>> gemm_holds(gemm_ctas);
  auto ready = [&](const GemmTile& t) {
    if (t.gemm == kWeightTile) return all_items_done == int64_t(m_blocks) * pieces && (!pull_x || x_done == m_blocks);
    if (t.gemm == 0) return pulled[t.m_block] != 0;
    if (t.gemm == kElementwiseItem) return gemm1_done[t.m_block] == n1;
    return gemm1_done[t.m_block] == n1 && items_done[t.m_block] == pieces;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int c = 0; c < comm_ctas; ++c) {
      int64_t& held = comm_holds[c];
      if (joined[c]) continue;
      if (held < 0 && next_item < items) held = next_item++, progress = true;
      if (held < 0 && in_place) {  // nothing left to dispatch: this CTA joins the GEMM tiles
        joined[c] = 1;
        gemm_holds.emplace_back();
        progress = true;
        continue;
      }
      if (held < 0) continue;
      const CommItem item = pull_x ? backward_comm_item(held, m_blocks) : comm_item(held, m_blocks, ring);
      const int32_t b = item.m_block;
      const bool can = item.combine ? gemm2_done[b] == n2 : item.x_rows || b < ring || pushed[b - ring] != 0;
      if (!can) continue;
      if (item.x_rows)
        ++x_done;
      else
        (item.combine ? pushed : pulled)[b] = 1;
      held = -1, ++finished, progress = true;
    }
    for (auto& held : gemm_holds) {
      if (held.size() < 2 && (held.empty() || ready(held.back())) && next_tile < tiles) {
        GemmTile t{kWeightTile, 0, 0};
        if (next_tile >= data_tiles)
          ++next_tile;
        else if (pieces > 0)
          with_items.tile(next_tile++, t);
        else
          plain.tile(next_tile++, t);
        held.push_back(t);
        progress = true;
      }
      if (!held.empty() && ready(held.front())) {
        const GemmTile t = held.front();
        held.pop_front();
        if (t.gemm == kElementwiseItem) ++all_items_done;
        if (t.gemm != kWeightTile) ++(t.gemm == 0 ? gemm1_done : t.gemm == 1 ? gemm2_done : items_done)[t.m_block];
        ++finished, progress = true;
      }
    }
  }
  return finished == work;
}

// The elementwise items' slices tile an item's rows exactly, each within one stage, and every segment
// lies within one row; rows of one group to many segments, the last one short.
TEST(ElementwiseSlices, TileTheItemsRowsInSegmentsThatFitAStage) {
  constexpr int32_t kSegmentGroups = 128, kPerSlice = 8;
  for (int64_t groups : {1, 8, 24, 96, 127, 128, 129, 192, 256, 272, 1792, 2000})
    for (int32_t rows : {1, 7, 32}) {
      SCOPED_TRACE("groups " + std::to_string(groups) + ", rows " + std::to_string(rows));
      const ElementwiseSlices e{groups, rows, kSegmentGroups, kPerSlice};
      ASSERT_EQ(e.segments(), rows * ((groups + kSegmentGroups - 1) / kSegmentGroups));
      int64_t at = 0;
      for (int32_t slice = 0; slice < e.slices(); ++slice) {
        ASSERT_EQ(e.slice_start(slice), at);
        const int64_t end = e.slice_end(slice);
        ASSERT_GT(end, at);
        ASSERT_LE(end - at, int64_t(kPerSlice) * kSegmentGroups);  // its groups fit stage A
        at = end;
      }
      EXPECT_EQ(at, rows * groups);
      for (int64_t q = 0; q < e.segments(); ++q) {
        const int64_t start = e.segment_start(q), end = e.segment_end(q);
        ASSERT_EQ(start, q == 0 ? 0 : e.segment_end(q - 1)) << "segment " << q;
        ASSERT_GE(end - start, 1) << "segment " << q;
        ASSERT_LE(end - start, kSegmentGroups) << "segment " << q;
        ASSERT_EQ(start / groups, (end - 1) / groups) << "segment " << q << " crosses a row";
        ASSERT_EQ(start % groups, q % e.segments_per_row() * kSegmentGroups) << "segment " << q;
      }
    }
}

TEST(WorkQueues, NeverDeadlockWithARingOfTwoMinibatches) {
  for (int32_t m_blocks : {1, 7, 40})
    for (int32_t bpm : {1, 2, 4})
      for (int comm : {1, 3})
        for (int gemm : {1, 2, 5, 40})
          for (int32_t ring_extra : {0, 1, 100}) {
            const int32_t ring = std::min(m_blocks, 2 * bpm + ring_extra);
            EXPECT_TRUE(simulate(m_blocks, bpm, 4, 3, ring, comm, gemm))
                << "M " << m_blocks << ", minibatch " << bpm << ", ring " << ring << ", comm " << comm << ", gemm "
                << gemm;
          }
}

// The E4M3 forward's queue (GEMM2 two minibatches behind GEMM1, the quantization items between) needs a
// ring of three minibatches across ranks, and two can deadlock.
TEST(WorkQueues, TheE4M3ForwardNeverDeadlocksWithARingOfThreeMinibatches) {
  for (int32_t m_blocks : {1, 7, 40})
    for (int32_t bpm : {1, 2, 4})
      for (int comm : {1, 3})
        for (int gemm : {1, 2, 5, 40})
          for (int32_t ring_extra : {0, 1, 100})
            for (int32_t pieces : {1, 2}) {
              const int32_t ring = std::min(m_blocks, 3 * bpm + ring_extra);
              EXPECT_TRUE(simulate(m_blocks, bpm, 4, 3, ring, comm, gemm, /*in_place=*/false, pieces))
                  << "M " << m_blocks << ", minibatch " << bpm << ", ring " << ring << ", comm " << comm << ", gemm "
                  << gemm << ", pieces " << pieces;
              EXPECT_TRUE(simulate(m_blocks, bpm, 4, 3, m_blocks, comm, gemm, /*in_place=*/true, pieces));
            }
  EXPECT_FALSE(simulate(/*m_blocks=*/12, /*bpm=*/2, /*n1=*/4, /*n2=*/3, /*ring=*/4, /*comm=*/2, /*gemm=*/2,
                        /*in_place=*/false, /*pieces=*/1));
}

TEST(WorkQueues, NeverDeadlockInPlace) {
  for (int32_t m_blocks : {0, 1, 7, 40})
    for (int32_t bpm : {1, 2, 4, 64})
      for (int comm : {1, 3})
        for (int gemm : {1, 2, 5, 40})
          EXPECT_TRUE(simulate(m_blocks, bpm, 4, 3, m_blocks, comm, gemm, /*in_place=*/true))
              << "M " << m_blocks << ", minibatch " << bpm << ", comm " << comm << ", gemm " << gemm;
}

// The fused backward: D1, S items and D2 tiles, then the weight gradients' W tiles, which wait for
// every S item and, where the x rows were not kept, every X item of the communication queue (in place:
// D then X items, whose CTAs then join the GEMM tiles; across ranks: D, X, then C items). Its ring holds
// every m-block.
TEST(WorkQueues, TheFusedBackwardWithWeightTilesNeverDeadlocks) {
  for (int32_t m_blocks : {0, 1, 7, 40})
    for (int32_t bpm : {1, 4, 64})
      for (int comm : {1, 3})
        for (int gemm : {1, 2, 5, 40})
          for (int64_t w_tiles : {0, 1, 9, 100})
            for (const bool in_place : {true, false})
              for (const bool pull_x : {true, false}) {
                if (!in_place && !pull_x) continue;  // across ranks the backward always pulls them
                EXPECT_TRUE(
                    simulate(m_blocks, bpm, 3, 8, m_blocks, comm, gemm, in_place, /*pieces=*/4, pull_x, w_tiles))
                    << "M " << m_blocks << ", minibatch " << bpm << ", comm " << comm << ", gemm " << gemm << ", W "
                    << w_tiles << ", in place " << in_place << ", x pulled " << pull_x;
              }
}

TEST(WorkQueues, InPlaceNeedsTheRingToHoldEveryMBlock) {
  // Without combine items nothing frees a ring slot: dispatch past the ring waits forever.
  EXPECT_FALSE(
      simulate(/*m_blocks=*/8, /*bpm=*/2, /*n1=*/4, /*n2=*/3, /*ring=*/4, /*comm=*/1, /*gemm=*/2, /*in_place=*/true));
}

TEST(WorkQueues, CanDeadlockWithARingOfOneMinibatch) {
  // Two GEMM CTAs both waiting on GEMM1 tiles of minibatch 1, whose rows need ring slots that only
  // GEMM2 of minibatch 0 (behind them in the queue) would free.
  EXPECT_FALSE(simulate(/*m_blocks=*/8, /*bpm=*/4, /*n1=*/4, /*n2=*/3, /*ring=*/4, /*comm=*/2, /*gemm=*/2));
}

}  // namespace
}  // namespace pounce::moe
