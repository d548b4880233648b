// One rank's routing plan at P = 1, made by the host planner and uploaded once: what the unfused
// chains (cuBLAS baseline, pounce unfused) read. The fused megakernel plans on the device instead.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/device_buffer.h"
#include "planner/schedule.h"

namespace pounce::baseline {

struct RoutingPlan {
  int64_t tokens = 0, topk = 0, routes = 0, padded_rows = 0;
  std::vector<int32_t> expert_routes;        // host [E]
  std::vector<int32_t> expert_offsets;       // host [E + 1], padded to 128-row m-blocks
  DeviceBuffer<int32_t> row_token;           // [padded rows], -1 for padding
  DeviceBuffer<int32_t> route_row;           // [tokens * topk]: the pool row of route (t, k)
  DeviceBuffer<int32_t> expert_offsets_dev;  // [E + 1]
  DeviceBuffer<int32_t> expert_routes_dev;   // [E]
};

// Validates topk_ids [tokens, k] against the config (ranks must be 1) and plans.
RoutingPlan make_routing_plan(const EpConfig& config, std::span<const int32_t> topk_ids, int64_t tokens);

}  // namespace pounce::baseline
