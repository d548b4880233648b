#include "reference/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "common/require.h"
#include "reference/stable_math.h"

namespace pounce::reference {
namespace {

void validate_config(const RouterConfig& c) {
  POUNCE_REQUIRE(c.experts > 0, "RouterConfig.experts = ", c.experts, " must be > 0");
  POUNCE_REQUIRE(c.topk >= 1 && c.topk <= c.experts, "RouterConfig.topk = ", c.topk,
                 " must be in [1, experts = ", c.experts, "]");
  POUNCE_REQUIRE(c.n_group >= 1 && c.experts % c.n_group == 0, "RouterConfig.n_group = ", c.n_group,
                 " must be >= 1 and divide experts = ", c.experts);
  POUNCE_REQUIRE(std::isfinite(c.scaling_factor), "RouterConfig.scaling_factor = ", c.scaling_factor, " is not finite");
  if (c.n_group == 1) return;
  const int group_size = c.experts / c.n_group;
  POUNCE_REQUIRE(c.topk_group >= 1 && c.topk_group <= c.n_group, "RouterConfig.topk_group = ", c.topk_group,
                 " must be in [1, n_group = ", c.n_group, "]");
  POUNCE_REQUIRE(c.topk <= c.topk_group * group_size, "RouterConfig.topk = ", c.topk, " exceeds the ",
                 c.topk_group * group_size, " experts of the kept groups (topk_group ", c.topk_group, " x ", group_size,
                 " experts per group)");
  POUNCE_REQUIRE(c.score != ScoreFunction::kSigmoid || group_size >= 2,
                 "sigmoid group-limited routing scores a group by its two best experts, but groups have ", group_size,
                 " expert (experts ", c.experts, " / n_group ", c.n_group, ")");
}

// Group score from the biased selection scores of its members.
double group_score(ScoreFunction score, const double* choice, int group_size) {
  double best = -std::numeric_limits<double>::infinity(), second = best;
  for (int j = 0; j < group_size; ++j) {
    if (choice[j] > best) {
      second = best;
      best = choice[j];
    } else if (choice[j] > second) {
      second = choice[j];
    }
  }
  return score == ScoreFunction::kSoftmax ? best : best + second;
}

// Moves the n best indices (higher value first, ties to the lower index) to the front of idx, in order.
void take_best(std::vector<int>& idx, const std::vector<double>& value, int n) {
  std::partial_sort(idx.begin(), idx.begin() + n, idx.end(),
                    [&](int a, int b) { return value[a] > value[b] || (value[a] == value[b] && a < b); });
}

}  // namespace

RouterOutput route(const RouterConfig& config, std::span<const float> logits, int64_t tokens,
                   std::span<const float> bias) {
  validate_config(config);
  const int E = config.experts, K = config.topk, G = config.n_group, group_size = E / G;
  POUNCE_REQUIRE(tokens >= 0, "route: tokens = ", tokens, " must be >= 0");
  POUNCE_REQUIRE(logits.size() == static_cast<size_t>(tokens * E), "logits has ", logits.size(),
                 " elements, expected T*E = ", tokens * E);
  POUNCE_REQUIRE(bias.empty() || bias.size() == static_cast<size_t>(E), "bias has ", bias.size(),
                 " elements, expected 0 or E = ", E);
  for (int e = 0; e < static_cast<int>(bias.size()); ++e) {
    POUNCE_REQUIRE(std::isfinite(bias[e]), "bias[expert ", e, "] = ", bias[e], " is not finite");
  }

  RouterOutput result;
  result.topk_ids.resize(tokens * K);
  result.topk_weights.resize(tokens * K);
  std::vector<double> score(E), choice(E), groups(G);
  std::vector<int> group_order(G), candidates;
  candidates.reserve(E);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* l = &logits[t * E];
    for (int e = 0; e < E; ++e) {
      POUNCE_REQUIRE(std::isfinite(l[e]), "logits[token ", t, "][expert ", e, "] = ", l[e], " is not finite");
    }
    if (config.score == ScoreFunction::kSoftmax) {
      const double max = *std::max_element(l, l + E);
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += score[e] = std::exp(double(l[e]) - max);
      for (int e = 0; e < E; ++e) score[e] /= sum;
    } else {
      for (int e = 0; e < E; ++e) score[e] = stable_sigmoid(l[e]);
    }
    for (int e = 0; e < E; ++e) choice[e] = score[e] + (bias.empty() ? 0.0 : double(bias[e]));

    // Candidates: every expert, or only those of the topk_group best groups.
    candidates.clear();
    if (G == 1) {
      for (int e = 0; e < E; ++e) candidates.push_back(e);
    } else {
      for (int g = 0; g < G; ++g) groups[g] = group_score(config.score, &choice[g * group_size], group_size);
      std::iota(group_order.begin(), group_order.end(), 0);
      take_best(group_order, groups, config.topk_group);
      for (int i = 0; i < config.topk_group; ++i) {
        for (int j = 0; j < group_size; ++j) candidates.push_back(group_order[i] * group_size + j);
      }
    }
    take_best(candidates, choice, K);

    double sum = 0;
    for (int k = 0; k < K; ++k) sum += score[candidates[k]];
    // All chosen scores can underflow to 0 (e.g. a huge bias picking hopeless experts): weights 0, not NaN.
    const bool divide = config.normalize && sum > 0;
    for (int k = 0; k < K; ++k) {
      const double weight = divide ? score[candidates[k]] / sum : score[candidates[k]];
      result.topk_ids[t * K + k] = candidates[k];
      result.topk_weights[t * K + k] = static_cast<float>(weight * config.scaling_factor);
    }
  }
  return result;
}

}  // namespace pounce::reference
