// Host side of the dispatch probe (moe/dispatch_probe.h): what each rank's communication CTAs move, in
// either mode, from the host planner's schedules. Pure C++, so the CPU suite checks it.
//
//   pull: rank d moves its own m-blocks 0 .. R_d - 1, an item each, every routed row from its source.
//   push: rank s moves, for b = 0, 1, ... and then d = 0 .. P - 1, the rows of d's m-block b whose source
//         is s (one item; none when there are none): every destination's m-block 0 comes first.
// R_d = min(ring blocks, d's m-blocks); row r of m-block b lands in ring row 128 b + r of its destination.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "planner/schedule.h"

namespace pounce::moe {

enum class DispatchMode { kPull = 0, kPush = 1 };
const char* dispatch_mode_name(DispatchMode mode);  // "pull", "push"

struct DispatchItem {
  int32_t dest;       // rank whose ring receives the rows
  int32_t block;      // the destination's m-block
  int32_t first_row;  // into the mover's DispatchRow list
  int32_t rows;       // 1 .. 128
};

struct DispatchRow {
  int32_t source, token;  // x[source][token]
  int32_t ring_row;       // row of the destination's ring
};

struct DispatchWork {
  std::vector<DispatchItem> items;
  std::vector<DispatchRow> rows;
};

// One rank's part: what it moves in each mode, and what it receives.
struct RankDispatchPlan {
  DispatchWork moves[2];             // [DispatchMode]
  std::vector<uint32_t> block_rows;  // routed rows of each m-block it receives (R_d of them)
  int64_t rows = 0;                  // routed rows it receives
  int64_t remote_rows = 0;           // of those, from other ranks
};

// Every rank's schedule (topk_ids[r]: rank r's [tokens_r, k] routing); validates config and routing.
std::vector<planner::RankSchedule> dispatch_schedules(const EpConfig& config,
                                                      std::span<const std::vector<int32_t>> topk_ids);

RankDispatchPlan plan_dispatch(std::span<const planner::RankSchedule> schedules, int rank, int64_t ring_blocks);

}  // namespace pounce::moe
