#include "planner/schedule.h"

#include <algorithm>
#include <cstdint>

#include "common/require.h"

namespace pounce::planner {

void validate_config(const EpConfig& c) {
  POUNCE_REQUIRE(c.ranks >= 1, "EP config: ranks = ", c.ranks, ", must be at least 1");
  POUNCE_REQUIRE(c.experts >= 1, "EP config: experts = ", c.experts, ", must be at least 1");
  POUNCE_REQUIRE(c.experts % c.ranks == 0, "EP config: experts = ", c.experts, " is not divisible by ranks = ", c.ranks,
                 " (each rank owns E/P contiguous experts)");
  POUNCE_REQUIRE(c.topk >= 1 && c.topk <= c.experts, "EP config: topk = ", c.topk,
                 " must lie in [1, experts = ", c.experts, "]");
  POUNCE_REQUIRE(c.hidden > 0 && c.hidden % kShapeQuantum == 0, "EP config: hidden = ", c.hidden,
                 " is not supported: it must be a positive multiple of ", kShapeQuantum);
  POUNCE_REQUIRE(c.intermediate > 0 && c.intermediate % kShapeQuantum == 0,
                 "EP config: intermediate = ", c.intermediate, " is not supported: it must be a positive multiple of ",
                 kShapeQuantum);
  POUNCE_REQUIRE(c.max_tokens_per_rank >= 0, "EP config: max_tokens_per_rank = ", c.max_tokens_per_rank,
                 " is negative");
  POUNCE_REQUIRE(c.max_routes_per_rank >= 0, "EP config: max_routes_per_rank = ", c.max_routes_per_rank,
                 " is negative (0: the worst case)");
}

}  // namespace pounce::planner

namespace pounce {

void check_config(const EpConfig& c) {
  POUNCE_REQUIRE(c.ranks >= 1 && c.ranks <= kMaxRanks, "EP config: ranks = ", c.ranks, " is not supported: 1 to ",
                 kMaxRanks, " ranks (one NVLink node)");
  planner::validate_config(c);
  POUNCE_REQUIRE(c.local_experts() <= kMaxLocalExperts, "EP config: ", c.local_experts(),
                 " experts per rank (experts = ", c.experts, " over ranks = ", c.ranks, ") is above the limit of ",
                 kMaxLocalExperts);
  POUNCE_REQUIRE(c.hidden <= kMaxHidden, "EP config: hidden = ", c.hidden, " is above the limit of ", kMaxHidden);
  POUNCE_REQUIRE(c.intermediate <= kMaxHidden, "EP config: intermediate = ", c.intermediate, " is above the limit of ",
                 kMaxHidden);
  POUNCE_REQUIRE(c.max_tokens_per_rank <= kMaxTokensPerRank, "EP config: max_tokens_per_rank = ", c.max_tokens_per_rank,
                 " is above the limit of ", kMaxTokensPerRank);
  planner::row_capacity(c);  // the routed rows must fit int32 row indices
}

}  // namespace pounce

namespace pounce::planner {

void validate_routing(const EpConfig& c, int rank, std::span<const int32_t> topk_ids, int64_t tokens) {
  POUNCE_REQUIRE(tokens >= 0 && tokens <= c.max_tokens_per_rank, "rank ", rank, " has ", tokens,
                 " tokens, outside [0, max_tokens_per_rank = ", c.max_tokens_per_rank, "]");
  POUNCE_REQUIRE(int64_t(topk_ids.size()) == tokens * c.topk, "rank ", rank, ": topk_ids has ", topk_ids.size(),
                 " entries, expected tokens * topk = ", tokens * c.topk);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* ids = topk_ids.data() + t * c.topk;
    for (int k = 0; k < c.topk; ++k) {
      POUNCE_REQUIRE(ids[k] >= 0 && ids[k] < c.experts, "rank ", rank, ": topk_ids[token ", t, "][k ", k,
                     "] = ", ids[k], " is out of range [0, ", c.experts, ")");
      for (int j = 0; j < k; ++j)
        POUNCE_REQUIRE(ids[j] != ids[k], "rank ", rank, ": token ", t, " lists expert ", ids[k], " twice (k ", j,
                       " and k ", k, ")");
    }
  }
}

Capacity row_capacity(const EpConfig& c) {
  validate_config(c);
  const int64_t worst_routes = int64_t(c.ranks) * c.max_tokens_per_rank * std::min(c.topk, c.local_experts());
  // Every non-empty expert adds at most kBlockM - 1 padding rows, and the padded total is a multiple
  // of kBlockM, so it is at most the largest multiple of kBlockM not above that sum.
  const auto capacity_of = [&](int64_t max_routes) {
    const int64_t busy_experts = std::min<int64_t>(c.local_experts(), max_routes);
    const int64_t padded = (max_routes + busy_experts * (kBlockM - 1)) / kBlockM * kBlockM;
    return Capacity{max_routes, padded, padded / kBlockM, max_routes < worst_routes};
  };
  // A token holds distinct experts, so it sends at most min(k, E_local) routes to one rank. The planners
  // count (and scan) a rank's routes in int32 whatever the bound: a routing past it is counted before it
  // is refused.
  const Capacity worst = capacity_of(worst_routes);
  POUNCE_REQUIRE(worst.max_padded_rows <= INT32_MAX, "EP config: up to ", worst.max_padded_rows,
                 " routed rows per rank do not fit int32 row indices; lower max_tokens_per_rank");
  if (c.max_routes_per_rank == 0 || c.max_routes_per_rank >= worst.max_routes) return worst;
  return capacity_of(c.max_routes_per_rank);
}

std::string describe_capacity(const EpConfig& c) {
  const Capacity cap = row_capacity(c);
  if (cap.bounded)
    return "the capacity, sized for " + std::to_string(cap.max_routes) + " routes per rank (max_routes_per_rank)";
  return "the capacity, sized for every route of " + std::to_string(c.max_tokens_per_rank) + " tokens on each of " +
         std::to_string(c.ranks) + " ranks landing on one (max_routes_per_rank bounds it)";
}

int64_t RankSchedule::routes() const {
  int64_t n = 0;
  for (int32_t r : expert_routes) n += r;
  return n;
}

RankSchedule build_schedule(const EpConfig& c, int rank, std::span<const std::span<const int32_t>> topk_ids,
                            std::span<const int64_t> tokens, int64_t minibatch_rows) {
  validate_config(c);
  POUNCE_REQUIRE(rank >= 0 && rank < c.ranks, "rank = ", rank, " is outside [0, ", c.ranks, ")");
  POUNCE_REQUIRE(int64_t(topk_ids.size()) == c.ranks && int64_t(tokens.size()) == c.ranks, "build_schedule: got ",
                 topk_ids.size(), " topk_ids and ", tokens.size(), " token counts for ", c.ranks, " ranks");
  POUNCE_REQUIRE(minibatch_rows > 0, "minibatch_rows = ", minibatch_rows, ", must be positive");
  for (int s = 0; s < c.ranks; ++s) validate_routing(c, s, topk_ids[s], tokens[s]);
  // Every rank's routes within a bounded capacity, as the device planners check (all ranks stop together).
  if (const Capacity cap = row_capacity(c); cap.bounded) {
    std::vector<int64_t> rank_routes(c.ranks, 0);
    for (int s = 0; s < c.ranks; ++s)
      for (int32_t id : topk_ids[s]) ++rank_routes[id / c.local_experts()];
    for (int q = 0; q < c.ranks; ++q)
      POUNCE_REQUIRE(rank_routes[q] <= cap.max_routes, "the routing sends rank ", q, " ", rank_routes[q],
                     " routes, more than the ", cap.max_routes, " its buffers hold (", describe_capacity(c), ")");
  }

  const int local = c.local_experts();
  const int first = c.first_local_expert(rank);
  RankSchedule out;
  out.rank = rank;
  out.expert_routes.assign(local, 0);

  // Counting sort by local expert. Scanning sources, tokens and k in order leaves each expert's
  // routes sorted by (source rank, token, k), the order the device planner must reproduce.
  for (int s = 0; s < c.ranks; ++s)
    for (int32_t id : topk_ids[s])
      if (id >= first && id < first + local) ++out.expert_routes[id - first];

  out.expert_offsets.assign(local + 1, 0);
  for (int e = 0; e < local; ++e) {
    int64_t padded = (int64_t(out.expert_routes[e]) + kBlockM - 1) / kBlockM * kBlockM;
    out.expert_offsets[e + 1] = int32_t(out.expert_offsets[e] + padded);
  }
  const int64_t rows = out.padded_rows();
  out.row_source_rank.assign(rows, -1);
  out.row_token.assign(rows, -1);
  out.row_k.assign(rows, -1);

  std::vector<int32_t> cursor(out.expert_offsets.begin(), out.expert_offsets.end() - 1);
  for (int s = 0; s < c.ranks; ++s)
    for (int64_t t = 0; t < tokens[s]; ++t)
      for (int k = 0; k < c.topk; ++k) {
        int32_t id = topk_ids[s][t * c.topk + k];
        if (id < first || id >= first + local) continue;
        int32_t row = cursor[id - first]++;
        out.row_source_rank[row] = s;
        out.row_token[row] = int32_t(t);
        out.row_k[row] = k;
      }

  const int64_t blocks_per_minibatch = (minibatch_rows + kBlockM - 1) / kBlockM;
  for (int64_t b = 0; b < out.m_blocks(); b += blocks_per_minibatch) out.minibatch_starts.push_back(int32_t(b));
  out.minibatch_starts.push_back(int32_t(out.m_blocks()));
  return out;
}

}  // namespace pounce::planner
