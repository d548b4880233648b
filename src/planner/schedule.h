// Routing planner: from every rank's topk_ids, the schedule of routes one rank's local experts will
// process (docs/design.md §4 step 2). Host reference now; the device planner must reproduce it bit for bit.
//
// Layout of one rank's schedule ("routed rows"):
//   routes to the rank's local experts, sorted by (local expert, source rank, token, k);
//   each expert's rows padded up to a multiple of kBlockM (padding rows carry source rank -1);
//   experts back to back, so m-block b (rows [128b, 128b+128)) belongs to exactly one expert;
//   minibatches are runs of consecutive m-blocks (they may span experts).
// Sizes never depend on the routing: row_capacity() bounds every array from (P, T_max, k, E) and the
// config's max_routes_per_rank; the planners stop a routing that sends a rank more routes than that.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/tiles.h"
#include "pounce/config.h"

namespace pounce::planner {

// Throws pounce::Error naming the first problem: P < 1, E not divisible by P, k outside [1, E],
// H or I not a positive multiple of 64, T_max < 0.
void validate_config(const EpConfig& config);

// Throws pounce::Error naming the first bad entry of one rank's topk_ids [tokens, k]: an expert id
// out of [0, E), the same expert twice in one token, tokens > T_max.
void validate_routing(const EpConfig& config, int rank, std::span<const int32_t> topk_ids, int64_t tokens);

struct Capacity {
  int64_t max_routes = 0;       // routes one rank can receive: P * T_max * min(k, E_local), or less when the
                                // config's max_routes_per_rank says so
  int64_t max_padded_rows = 0;  // routed rows after per-expert padding, a multiple of kBlockM
  int64_t max_m_blocks = 0;     // max_padded_rows / kBlockM
  bool bounded = false;         // below the worst case: the planners check every rank's routes against it
};
Capacity row_capacity(const EpConfig& config);
// What the capacity was sized for, for error messages: "sized for 65536 routes (max_routes_per_rank)".
std::string describe_capacity(const EpConfig& config);

struct RankSchedule {
  int rank = 0;
  std::vector<int32_t> expert_routes;     // [E_local] routes per local expert (unpadded)
  std::vector<int32_t> expert_offsets;    // [E_local + 1] first padded row of each expert; back = padded rows
  std::vector<int32_t> row_source_rank;   // [padded rows] source rank of the route, -1 for padding
  std::vector<int32_t> row_token;         // [padded rows] token index on the source rank, -1 for padding
  std::vector<int32_t> row_k;             // [padded rows] position in the token's top-k, -1 for padding
  std::vector<int32_t> minibatch_starts;  // m-block where each minibatch starts, then the total m-blocks

  int64_t padded_rows() const { return expert_offsets.empty() ? 0 : expert_offsets.back(); }
  int64_t m_blocks() const { return padded_rows() / kBlockM; }
  int64_t minibatches() const { return minibatch_starts.empty() ? 0 : int64_t(minibatch_starts.size()) - 1; }
  int64_t routes() const;
};

// topk_ids[r] is rank r's [tokens[r], k] routing. Validates config and every rank's routing first, and
// throws when any rank receives more routes than the capacity (row_capacity).
// minibatch_rows > 0; each minibatch holds ceil(minibatch_rows / kBlockM) m-blocks (the last may hold fewer).
RankSchedule build_schedule(const EpConfig& config, int rank, std::span<const std::span<const int32_t>> topk_ids,
                            std::span<const int64_t> tokens, int64_t minibatch_rows);

}  // namespace pounce::planner
