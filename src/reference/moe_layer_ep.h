// Expert-parallel view of the host reference: the same layer split over P ranks, computed the way the
// megakernel computes it, so its tests pin down the protocol before any kernel exists.
//   1. each rank r plans its routed rows with planner::build_schedule (all ranks' topk_ids);
//   2. dispatch: rank r gathers the x rows of its routes from the source ranks;
//   3. its local experts process them (the single-device reference with one route per row);
//   4. combine: each output row goes to the unique slot [token, k] of its source rank;
//   5. each source rank sums its slots: y[t] = sum_k w[t,k] * slot[t,k], k in order.
// Backward mirrors it: dy rows are pulled per route, dx rows pushed to slots [token, k] and summed in
// k order; each rank keeps the weight gradients of its local experts.
// P = 1 must agree with moe_forward/moe_backward on the same tokens (tests check it).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "planner/schedule.h"

namespace pounce::reference {

struct EpRankInputs {
  int64_t tokens = 0;
  std::span<const float> x;             // [tokens, H]
  std::span<const int32_t> topk_ids;    // [tokens, k], global expert ids
  std::span<const float> topk_weights;  // [tokens, k]
  std::span<const float> dy;            // [tokens, H]; backward only
};

struct EpRankResult {
  std::vector<double> y;               // [tokens, H]
  std::vector<double> dx;              // [tokens, H]            (backward)
  std::vector<double> d_topk_weights;  // [tokens, k]            (backward)
  std::vector<double> dw13;            // [E/P, 2I, H] local experts (backward)
  std::vector<double> dw2;             // [E/P, H, I]  local experts (backward)
};

// w13 [E, 2I, H] and w2 [E, H, I] hold all experts; rank r uses experts [r*E/P, (r+1)*E/P).
// with_backward = false leaves the backward fields empty and ignores dy.
std::vector<EpRankResult> moe_layer_ep(const EpConfig& config, std::span<const EpRankInputs> ranks,
                                       std::span<const float> w13, std::span<const float> w2, bool with_backward);

}  // namespace pounce::reference
