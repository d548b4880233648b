#include "reference/synthetic_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/require.h"

namespace pounce::reference {

RoutingPattern parse_routing_pattern(const std::string& name) {
  if (name == "uniform") return RoutingPattern::kUniform;
  if (name == "zipf") return RoutingPattern::kZipf;
  if (name == "one_expert") return RoutingPattern::kOneExpert;
  if (name == "half_empty") return RoutingPattern::kHalfEmpty;
  if (name == "balanced") return RoutingPattern::kBalanced;
  POUNCE_FAIL("unknown routing pattern '", name, "' (expected uniform, zipf, one_expert, half_empty or balanced)");
}

const char* routing_pattern_name(RoutingPattern pattern) {
  switch (pattern) {
    case RoutingPattern::kUniform:
      return "uniform";
    case RoutingPattern::kZipf:
      return "zipf";
    case RoutingPattern::kOneExpert:
      return "one_expert";
    case RoutingPattern::kHalfEmpty:
      return "half_empty";
    case RoutingPattern::kBalanced:
      return "balanced";
  }
  return "?";
}

namespace {

// Draws `count` distinct entries of `pool` (a partial Fisher-Yates shuffle of a copy) into out.
void pick_distinct(std::vector<int32_t> pool, int count, std::mt19937_64& rng, int32_t* out) {
  for (int i = 0; i < count; ++i) {
    std::uniform_int_distribution<size_t> pick(i, pool.size() - 1);
    std::swap(pool[i], pool[pick(rng)]);
    out[i] = pool[i];
  }
}

}  // namespace

std::vector<int32_t> synthetic_topk_ids(RoutingPattern pattern, int64_t tokens, int experts, int topk,
                                        std::mt19937_64& rng) {
  POUNCE_REQUIRE(topk >= 1 && topk <= experts, "synthetic routing: topk = ", topk, " must lie in [1, ", experts, "]");
  std::vector<int32_t> ids(tokens * topk);
  std::vector<int32_t> all(experts);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);  // random identity for "hot" / "kept" experts

  switch (pattern) {
    case RoutingPattern::kUniform:
      for (int64_t t = 0; t < tokens; ++t) pick_distinct(all, topk, rng, &ids[t * topk]);
      break;
    case RoutingPattern::kZipf: {
      // Sampling k experts without replacement with probability ~ weight is a top-k over
      // log(weight) + Gumbel noise.
      std::vector<double> log_weight(experts);
      for (int r = 0; r < experts; ++r) log_weight[all[r]] = -1.2 * std::log(double(r + 1));
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      std::vector<std::pair<double, int32_t>> keys(experts);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int e = 0; e < experts; ++e) {
          double u = std::max(unit(rng), 1e-300);
          keys[e] = {log_weight[e] - std::log(-std::log(u)), e};
        }
        std::partial_sort(keys.begin(), keys.begin() + topk, keys.end(), std::greater<>());
        for (int k = 0; k < topk; ++k) ids[t * topk + k] = keys[k].second;
      }
      break;
    }
    case RoutingPattern::kOneExpert: {
      std::vector<int32_t> rest(all.begin() + 1, all.end());
      for (int64_t t = 0; t < tokens; ++t) {
        ids[t * topk] = all[0];
        pick_distinct(rest, topk - 1, rng, &ids[t * topk + 1]);
      }
      break;
    }
    case RoutingPattern::kHalfEmpty: {
      POUNCE_REQUIRE(2 * topk <= experts, "half_empty routing needs topk <= experts / 2, got topk = ", topk,
                     ", experts = ", experts);
      std::vector<int32_t> kept(all.begin(), all.begin() + experts / 2);
      for (int64_t t = 0; t < tokens; ++t) pick_distinct(kept, topk, rng, &ids[t * topk]);
      break;
    }
    case RoutingPattern::kBalanced:
      // Route i = t k + j goes to expert all[i % E]: the k routes of a token are k consecutive entries of
      // the cycle (distinct, since k <= E), and every expert is hit once per E routes.
      for (int64_t i = 0; i < tokens * topk; ++i) ids[i] = all[i % experts];
      break;
  }
  return ids;
}

std::vector<float> synthetic_topk_weights(int64_t tokens, int topk, std::mt19937_64& rng) {
  std::normal_distribution<float> logit(0.0f, 1.0f);
  std::vector<float> w(tokens * topk);
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0;
    for (int k = 0; k < topk; ++k) sum += w[t * topk + k] = std::exp(logit(rng));
    for (int k = 0; k < topk; ++k) w[t * topk + k] /= sum;
  }
  return w;
}

}  // namespace pounce::reference
