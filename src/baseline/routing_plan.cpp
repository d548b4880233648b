#include "baseline/routing_plan.h"

#include "common/require.h"

namespace pounce::baseline {

RoutingPlan make_routing_plan(const EpConfig& config, std::span<const int32_t> topk_ids, int64_t tokens) {
  POUNCE_REQUIRE(config.ranks == 1, "make_routing_plan plans one rank; config has ", config.ranks);
  const std::span<const int32_t> per_rank[1] = {topk_ids};
  const int64_t token_counts[1] = {tokens};
  const planner::RankSchedule s = planner::build_schedule(config, 0, per_rank, token_counts, kBlockM);

  RoutingPlan plan;
  plan.tokens = tokens;
  plan.topk = config.topk;
  plan.routes = s.routes();
  plan.padded_rows = s.padded_rows();
  plan.expert_routes = s.expert_routes;
  plan.expert_offsets = s.expert_offsets;
  std::vector<int32_t> route_row(tokens * config.topk, -1);
  for (int64_t row = 0; row < plan.padded_rows; ++row)
    if (s.row_token[row] >= 0) route_row[int64_t(s.row_token[row]) * config.topk + s.row_k[row]] = int32_t(row);
  plan.row_token = DeviceBuffer<int32_t>(s.row_token);
  plan.route_row = DeviceBuffer<int32_t>(route_row);
  plan.expert_offsets_dev = DeviceBuffer<int32_t>(s.expert_offsets);
  plan.expert_routes_dev = DeviceBuffer<int32_t>(s.expert_routes);
  return plan;
}

}  // namespace pounce::baseline
