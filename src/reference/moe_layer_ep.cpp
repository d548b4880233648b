#include "reference/moe_layer_ep.h"

#include "common/require.h"
#include "reference/moe_layer.h"

namespace pounce::reference {

std::vector<EpRankResult> moe_layer_ep(const EpConfig& c, std::span<const EpRankInputs> ranks,
                                       std::span<const float> w13, std::span<const float> w2, bool with_backward) {
  planner::validate_config(c);
  POUNCE_REQUIRE(int64_t(ranks.size()) == c.ranks, "moe_layer_ep: got inputs for ", ranks.size(), " ranks, config has ",
                 c.ranks);
  const int64_t H = c.hidden, I = c.intermediate, k = c.topk, local = c.local_experts();
  POUNCE_REQUIRE(int64_t(w13.size()) == c.experts * 2 * I * H && int64_t(w2.size()) == c.experts * H * I,
                 "moe_layer_ep: weights have ", w13.size(), " / ", w2.size(),
                 " elements, expected E*2I*H = ", c.experts * 2 * I * H, " / E*H*I = ", c.experts * H * I);
  std::vector<std::span<const int32_t>> ids;
  std::vector<int64_t> tokens;
  for (const EpRankInputs& r : ranks) {
    ids.push_back(r.topk_ids);
    tokens.push_back(r.tokens);
    POUNCE_REQUIRE(int64_t(r.x.size()) == r.tokens * H, "moe_layer_ep: x has ", r.x.size(), " elements, expected ",
                   r.tokens * H);
    POUNCE_REQUIRE(int64_t(r.topk_weights.size()) == r.tokens * k, "moe_layer_ep: topk_weights has ",
                   r.topk_weights.size(), " elements, expected ", r.tokens * k);
    POUNCE_REQUIRE(!with_backward || int64_t(r.dy.size()) == r.tokens * H, "moe_layer_ep: dy has ", r.dy.size(),
                   " elements, expected ", r.tokens * H);
  }

  // Symmetric combine buffers: one slot per (token, k) on every source rank, written by exactly one
  // expert rank, so no slot is ever accumulated into.
  std::vector<std::vector<double>> out_slots(c.ranks), dx_slots(c.ranks), dw_slots(c.ranks);
  for (int r = 0; r < c.ranks; ++r) {
    out_slots[r].assign(ranks[r].tokens * k * H, 0.0);
    if (with_backward) {
      dx_slots[r].assign(ranks[r].tokens * k * H, 0.0);
      dw_slots[r].assign(ranks[r].tokens * k, 0.0);
    }
  }

  std::vector<EpRankResult> results(c.ranks);
  for (int rank = 0; rank < c.ranks; ++rank) {
    // minibatch_rows only shapes the schedule's minibatch list, which the reference does not use.
    planner::RankSchedule s = planner::build_schedule(c, rank, ids, tokens, kBlockM);

    // Dispatch: one row per route (padding rows are not data), expert ids made local.
    std::vector<float> x_routed, w_routed;
    std::vector<int32_t> e_routed;
    std::vector<int64_t> routed_row_of;  // schedule row of each routed row
    for (int e = 0; e < local; ++e)
      for (int64_t row = s.expert_offsets[e]; row < s.expert_offsets[e] + s.expert_routes[e]; ++row) {
        const EpRankInputs& src = ranks[s.row_source_rank[row]];
        const int64_t t = s.row_token[row];
        x_routed.insert(x_routed.end(), src.x.begin() + t * H, src.x.begin() + (t + 1) * H);
        w_routed.push_back(src.topk_weights[t * k + s.row_k[row]]);
        e_routed.push_back(e);
        routed_row_of.push_back(row);
      }
    const int64_t R = int64_t(e_routed.size());
    const MoeShape shape{.tokens = R, .hidden = H, .intermediate = I, .experts = local, .topk = 1};
    std::span<const float> w13_local = w13.subspan(c.first_local_expert(rank) * 2 * I * H, local * 2 * I * H);
    std::span<const float> w2_local = w2.subspan(c.first_local_expert(rank) * H * I, local * H * I);
    std::vector<float> ones(R, 1.0f);
    const MoeInputs forward_in{x_routed, e_routed, ones, w13_local, w2_local};

    // Expert FFN, then combine: push each output row (before the router weight) to its slot.
    const MoeRouteActivations act = moe_route_activations(shape, forward_in);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t row = routed_row_of[i];
      const int src = s.row_source_rank[row];
      const int64_t slot = int64_t(s.row_token[row]) * k + s.row_k[row];
      std::copy(act.out.begin() + i * H, act.out.begin() + (i + 1) * H, out_slots[src].begin() + slot * H);
    }
    if (!with_backward) continue;

    // Backward: pull dy per route; the route's router weight scales it inside moe_backward.
    std::vector<float> dy_routed;
    for (int64_t i = 0; i < R; ++i) {
      const int64_t row = routed_row_of[i];
      const EpRankInputs& src = ranks[s.row_source_rank[row]];
      const int64_t t = s.row_token[row];
      dy_routed.insert(dy_routed.end(), src.dy.begin() + t * H, src.dy.begin() + (t + 1) * H);
    }
    const MoeInputs backward_in{x_routed, e_routed, w_routed, w13_local, w2_local};
    MoeGradients g = moe_backward(shape, backward_in, dy_routed);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t row = routed_row_of[i];
      const int src = s.row_source_rank[row];
      const int64_t slot = int64_t(s.row_token[row]) * k + s.row_k[row];
      std::copy(g.dx.begin() + i * H, g.dx.begin() + (i + 1) * H, dx_slots[src].begin() + slot * H);
      dw_slots[src][slot] = g.d_topk_weights[i];
    }
    results[rank].dw13 = std::move(g.dw13);
    results[rank].dw2 = std::move(g.dw2);
  }

  // Weighted sum on each source rank, k in fixed order.
  for (int r = 0; r < c.ranks; ++r) {
    const EpRankInputs& in = ranks[r];
    EpRankResult& res = results[r];
    res.y.assign(in.tokens * H, 0.0);
    for (int64_t t = 0; t < in.tokens; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const double w = in.topk_weights[t * k + j];
        const double* slot = &out_slots[r][(t * k + j) * H];
        for (int64_t h = 0; h < H; ++h) res.y[t * H + h] += w * slot[h];
      }
    if (!with_backward) continue;
    res.dx.assign(in.tokens * H, 0.0);
    for (int64_t t = 0; t < in.tokens; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const double* slot = &dx_slots[r][(t * k + j) * H];
        for (int64_t h = 0; h < H; ++h) res.dx[t * H + h] += slot[h];
      }
    res.d_topk_weights = std::move(dw_slots[r]);
  }
  return results;
}

}  // namespace pounce::reference
