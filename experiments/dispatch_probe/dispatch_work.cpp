#include "dispatch_probe/dispatch_work.h"

#include <algorithm>

#include "common/require.h"

namespace pounce::moe {

const char* dispatch_mode_name(DispatchMode mode) { return mode == DispatchMode::kPull ? "pull" : "push"; }

std::vector<planner::RankSchedule> dispatch_schedules(const EpConfig& config,
                                                      std::span<const std::vector<int32_t>> topk_ids) {
  planner::validate_config(config);
  POUNCE_REQUIRE(int(topk_ids.size()) == config.ranks, "dispatch probe: routing of ", topk_ids.size(),
                 " ranks, the config has ", config.ranks);
  const std::vector<std::span<const int32_t>> ids(topk_ids.begin(), topk_ids.end());
  std::vector<int64_t> tokens;
  for (const auto& r : topk_ids) tokens.push_back(int64_t(r.size()) / config.topk);
  std::vector<planner::RankSchedule> schedules;
  for (int d = 0; d < config.ranks; ++d)  // build_schedule validates the routing
    schedules.push_back(planner::build_schedule(config, d, ids, tokens, kBlockM));
  return schedules;
}

RankDispatchPlan plan_dispatch(std::span<const planner::RankSchedule> schedules, int rank, int64_t ring_blocks) {
  const int P = int(schedules.size());
  auto moved_blocks = [&](int d) { return std::min(ring_blocks, schedules[d].m_blocks()); };
  RankDispatchPlan plan;
  // Rows of destination d's m-block b whose source is `only` (-1: any) as one item of `mode`, if any.
  auto add_item = [&](DispatchMode mode, int d, int64_t b, int only) {
    DispatchWork& w = plan.moves[int(mode)];
    const int32_t first = int32_t(w.rows.size());
    for (int64_t row = b * kBlockM; row < (b + 1) * kBlockM; ++row) {
      const int32_t source = schedules[d].row_source_rank[row];
      if (source >= 0 && (only < 0 || source == only))
        w.rows.push_back({source, schedules[d].row_token[row], int32_t(row)});
    }
    const int32_t n = int32_t(w.rows.size()) - first;
    if (n > 0) w.items.push_back({d, int32_t(b), first, n});
    return n;
  };
  for (int64_t b = 0; b < moved_blocks(rank); ++b) {
    const int32_t n = add_item(DispatchMode::kPull, rank, b, -1);
    // Padding only completes an expert's last m-block: every m-block holds a routed row.
    POUNCE_REQUIRE(n > 0, "dispatch probe: rank ", rank, "'s m-block ", b, " holds no routed row");
    plan.block_rows.push_back(uint32_t(n));
  }
  for (const DispatchRow& row : plan.moves[int(DispatchMode::kPull)].rows) plan.remote_rows += row.source != rank;
  plan.rows = int64_t(plan.moves[int(DispatchMode::kPull)].rows.size());
  int64_t most_blocks = 0;
  for (int d = 0; d < P; ++d) most_blocks = std::max(most_blocks, moved_blocks(d));
  for (int64_t b = 0; b < most_blocks; ++b)
    for (int d = 0; d < P; ++d)
      if (b < moved_blocks(d)) add_item(DispatchMode::kPush, d, b, rank);
  return plan;
}

}  // namespace pounce::moe
