// Tests of the router reference: hand-checked examples, and random logits against a brute force that
// enumerates every set of kept groups and picks experts by repeated argmax.
#include "reference/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/require.h"
#include "common/testing.h"

namespace pounce::reference {
namespace {

using pounce::testing::fresh_rng;

using pounce::testing::expect_error;

RouterConfig softmax_config(int experts, int topk) {
  RouterConfig c;
  c.experts = experts;
  c.topk = topk;
  return c;
}

// DeepSeek-V3 style: sigmoid scores, selection bias, group-limited, scaled.
RouterConfig deepseek_config(int experts, int n_group, int topk_group, int topk) {
  RouterConfig c;
  c.experts = experts;
  c.topk = topk;
  c.score = ScoreFunction::kSigmoid;
  c.n_group = n_group;
  c.topk_group = topk_group;
  c.scaling_factor = 2.5f;
  return c;
}

// ---- brute force ------------------------------------------------------------------------------------

struct TokenRoute {
  std::vector<int> ids;
  std::vector<double> weights;
};

// One token by brute force: the kept groups are the subset of topk_group groups with the largest total
// group score (the same as the best groups one by one when there are no ties), then experts are taken by
// repeated argmax over that subset.
TokenRoute brute_force(const RouterConfig& c, const float* logits, const std::vector<float>& bias) {
  const int E = c.experts, group_size = E / c.n_group;
  std::vector<double> score(E), choice(E);
  double total = 0;
  for (int e = 0; e < E; ++e) total += std::exp(double(logits[e]));  // logits are small: no overflow
  for (int e = 0; e < E; ++e) {
    score[e] = c.score == ScoreFunction::kSoftmax ? std::exp(double(logits[e])) / total
                                                  : 1.0 / (1.0 + std::exp(-double(logits[e])));
    choice[e] = score[e] + (bias.empty() ? 0.0 : bias[e]);
  }

  auto group_value = [&](int g) {
    std::vector<double> members(choice.begin() + g * group_size, choice.begin() + (g + 1) * group_size);
    std::sort(members.begin(), members.end(), std::greater<>());
    return c.score == ScoreFunction::kSoftmax ? members[0] : members[0] + members[1];
  };
  uint32_t kept = (1u << c.n_group) - 1;
  if (c.n_group > 1) {
    double best = -std::numeric_limits<double>::infinity();
    for (uint32_t subset = 0; subset < (1u << c.n_group); ++subset) {
      if (std::popcount(subset) != c.topk_group) continue;
      double sum = 0;
      for (int g = 0; g < c.n_group; ++g) {
        if (subset >> g & 1) sum += group_value(g);
      }
      if (sum > best) {
        best = sum;
        kept = subset;
      }
    }
  }

  std::vector<bool> available(E);
  for (int e = 0; e < E; ++e) available[e] = kept >> (e / group_size) & 1;
  TokenRoute r;
  double sum = 0;
  for (int k = 0; k < c.topk; ++k) {
    int arg = -1;
    for (int e = 0; e < E; ++e) {
      if (available[e] && (arg < 0 || choice[e] > choice[arg])) arg = e;
    }
    available[arg] = false;
    r.ids.push_back(arg);
    r.weights.push_back(score[arg]);
    sum += score[arg];
  }
  for (double& w : r.weights) w = (c.normalize ? w / sum : w) * c.scaling_factor;
  return r;
}

void expect_matches_brute_force(const RouterConfig& c, const std::vector<float>& logits, int64_t tokens,
                                const std::vector<float>& bias) {
  const RouterOutput out = route(c, logits, tokens, bias);
  ASSERT_EQ(out.topk_ids.size(), size_t(tokens * c.topk));
  ASSERT_EQ(out.topk_weights.size(), size_t(tokens * c.topk));
  for (int64_t t = 0; t < tokens; ++t) {
    const TokenRoute want = brute_force(c, &logits[t * c.experts], bias);
    for (int k = 0; k < c.topk; ++k) {
      EXPECT_EQ(out.topk_ids[t * c.topk + k], want.ids[k]) << "token " << t << " k " << k;
      EXPECT_NEAR(out.topk_weights[t * c.topk + k], want.weights[k], 1e-6 * std::abs(want.weights[k]))
          << "token " << t << " k " << k;
    }
  }
}

std::vector<float> random_values(std::mt19937_64& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// ---- hand-checked examples -----------------------------------------------------------------------------

TEST(Router, SoftmaxTopKHandChecked) {
  const std::vector<float> logits = {1,    3,  2,    0,   // token 0
                                     0.5f, -1, 0.5f, 2};  // token 1: experts 0 and 2 tie, 0 wins
  RouterConfig c = softmax_config(4, 2);
  RouterOutput out = route(c, logits, 2);
  EXPECT_EQ(out.topk_ids, (std::vector<int32_t>{1, 2, 3, 0}));
  const double want_normalized[] = {0.7310585786300048, 0.2689414213699951, 0.8175744761936438, 0.18242552380635635};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out.topk_weights[i], want_normalized[i], 1e-7) << i;

  c.normalize = false;
  out = route(c, logits, 2);
  EXPECT_EQ(out.topk_ids, (std::vector<int32_t>{1, 2, 3, 0}));
  EXPECT_NEAR(out.topk_weights[0], 0.6439142598879724, 1e-7);
  EXPECT_NEAR(out.topk_weights[1], 0.23688281808991016, 1e-7);

  // Softmax is shift-invariant, and large logits must not overflow exp().
  out = route(c, std::vector<float>{1001, 1003, 1002, 1000}, 1);
  EXPECT_EQ(out.topk_ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(out.topk_weights[0], 0.6439142598879724, 1e-7);
  EXPECT_NEAR(out.topk_weights[1], 0.23688281808991016, 1e-7);
}

TEST(Router, BiasAffectsSelectionNotWeights) {
  const std::vector<float> logits = {2, 1, 0, -1, -2, 0.5f, 1.5f, -3};
  RouterConfig c = softmax_config(8, 2);
  c.score = ScoreFunction::kSigmoid;
  EXPECT_EQ(route(c, logits, 1).topk_ids, (std::vector<int32_t>{0, 6}));

  std::vector<float> bias(8, 0.0f);
  bias[7] = 10.0f;
  const RouterOutput out = route(c, logits, 1, bias);
  EXPECT_EQ(out.topk_ids, (std::vector<int32_t>{7, 0}));
  // sigmoid(-3) / (sigmoid(-3) + sigmoid(2)) and sigmoid(2) / (...): the bias is not in the weights.
  EXPECT_NEAR(out.topk_weights[0], 0.05109319169336548, 1e-7);
  EXPECT_NEAR(out.topk_weights[1], 0.9489068083066345, 1e-7);
}

TEST(Router, NormalizeAndScalingFactor) {
  const std::vector<float> logits = {2, 1, 0, -1, -2, 0.5f, 1.5f, -3};
  RouterConfig c = softmax_config(8, 2);
  c.score = ScoreFunction::kSigmoid;
  c.scaling_factor = 2.5f;
  std::vector<float> bias(8, 0.0f);
  bias[7] = 10.0f;

  c.normalize = false;
  RouterOutput out = route(c, logits, 1, bias);
  EXPECT_NEAR(out.topk_weights[0], 2.5 * 0.04742587317756678, 1e-7);
  EXPECT_NEAR(out.topk_weights[1], 2.5 * 0.8807970779778823, 1e-6);

  c.normalize = true;
  out = route(c, logits, 1, bias);
  EXPECT_NEAR(out.topk_weights[0], 2.5 * 0.05109319169336548, 1e-6);
  EXPECT_NEAR(out.topk_weights[1], 2.5 * 0.9489068083066345, 1e-6);
  EXPECT_NEAR(out.topk_weights[0] + out.topk_weights[1], 2.5, 1e-6);
}

TEST(Router, GroupLimitExcludesTheBestExpertOfAWeakGroup) {
  // Groups of two. Group 0 holds the best expert (logit 3) but its pair sums to sigmoid(3) + sigmoid(-3)
  // = 1.0, below groups 1 (2 sigmoid(1) = 1.46) and 2 (2 sigmoid(0.9) = 1.42).
  const std::vector<float> logits = {3, -3, 1, 1, 0.9f, 0.9f, -1, -1};
  RouterConfig c = deepseek_config(8, 4, 2, 3);
  EXPECT_EQ(route(c, logits, 1).topk_ids, (std::vector<int32_t>{2, 3, 4}));
  // Softmax scores a group by its best expert instead: group 0 is kept.
  c.score = ScoreFunction::kSoftmax;
  EXPECT_EQ(route(c, logits, 1).topk_ids, (std::vector<int32_t>{0, 2, 3}));
}

TEST(Router, TiesGoToTheLowerIndex) {
  const std::vector<float> equal(8, 0.25f);
  EXPECT_EQ(route(softmax_config(8, 3), equal, 1).topk_ids, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(route(deepseek_config(8, 4, 2, 3), equal, 1).topk_ids, (std::vector<int32_t>{0, 1, 2}));

  // Groups 1 and 3 tie for best: one kept group means group 1, two mean groups 1 and 3, whose experts
  // then tie among themselves.
  const std::vector<float> logits = {0, 0, 1, 1, -1, -1, 1, 1};
  EXPECT_EQ(route(deepseek_config(8, 4, 1, 2), logits, 1).topk_ids, (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(route(deepseek_config(8, 4, 2, 3), logits, 1).topk_ids, (std::vector<int32_t>{2, 3, 6}));
}

TEST(Router, NoTokens) {
  const RouterOutput out = route(deepseek_config(16, 4, 2, 4), {}, 0);
  EXPECT_TRUE(out.topk_ids.empty());
  EXPECT_TRUE(out.topk_weights.empty());
}

// ---- random logits against the brute force --------------------------------------------------------------

TEST(Router, SoftmaxTopKMatchesBruteForce) {
  auto rng = fresh_rng();
  const int64_t T = 200;
  for (bool normalize : {true, false}) {
    RouterConfig c = softmax_config(64, 6);
    c.normalize = normalize;
    SCOPED_TRACE(normalize ? "normalized" : "not normalized");
    expect_matches_brute_force(c, random_values(rng, T * 64, -4, 4), T, {});
  }
}

TEST(Router, SigmoidBiasGroupLimitedMatchesBruteForce) {
  auto rng = fresh_rng();
  const int64_t T = 200;
  // E 16 in 4 groups, and the DeepSeek-V3 configuration itself (256 experts, 8 groups, keep 4, top-8).
  for (const RouterConfig& c : {deepseek_config(16, 4, 2, 4), deepseek_config(256, 8, 4, 8)}) {
    SCOPED_TRACE("experts " + std::to_string(c.experts));
    // A bias comparable to the score spread, so it changes selections.
    expect_matches_brute_force(c, random_values(rng, T * c.experts, -4, 4), T,
                               random_values(rng, c.experts, -0.3f, 0.3f));
  }
}

TEST(Router, SoftmaxGroupLimitedMatchesBruteForce) {
  auto rng = fresh_rng();
  RouterConfig c = softmax_config(32, 5);
  c.n_group = 8;
  c.topk_group = 3;
  expect_matches_brute_force(c, random_values(rng, 100 * 32, -4, 4), 100, random_values(rng, 32, -0.05f, 0.05f));
}

// ---- invalid input -----------------------------------------------------------------------------------------

TEST(Router, RejectsInvalidConfigs) {
  const std::vector<float> logits(16, 0.0f);
  expect_error([&] { route(softmax_config(16, 17), logits, 1); }, "topk = 17 must be in [1, experts = 16]");
  expect_error([&] { route(softmax_config(16, 0), logits, 1); }, "topk = 0 must be in [1, experts = 16]");
  expect_error([&] { route(deepseek_config(16, 3, 2, 4), logits, 1); },
               "n_group = 3 must be >= 1 and divide experts = 16");
  expect_error([&] { route(deepseek_config(16, 4, 5, 4), logits, 1); }, "topk_group = 5 must be in [1, n_group = 4]");
  expect_error([&] { route(deepseek_config(16, 4, 1, 5), logits, 1); },
               "topk = 5 exceeds the 4 experts of the kept groups (topk_group 1 x 4 experts per group)");
  expect_error([&] { route(deepseek_config(16, 16, 4, 2), logits, 1); },
               "groups have 1 expert (experts 16 / n_group 16)");
  RouterConfig c = softmax_config(16, 2);
  c.scaling_factor = std::numeric_limits<float>::infinity();
  expect_error([&] { route(c, logits, 1); }, "scaling_factor = inf is not finite");
}

TEST(Router, RejectsBadInputs) {
  const RouterConfig c = softmax_config(16, 2);
  const std::vector<float> logits(3 * 16, 0.5f);
  expect_error([&] { route(c, logits, 2); }, "logits has 48 elements, expected T*E = 32");
  expect_error([&] { route(c, logits, -1); }, "tokens = -1 must be >= 0");
  expect_error([&] { route(c, logits, 3, std::vector<float>(15, 0.0f)); },
               "bias has 15 elements, expected 0 or E = 16");
  std::vector<float> bad = logits;
  bad[2 * 16 + 5] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { route(c, bad, 3); }, "logits[token 2][expert 5] = nan is not finite");
  std::vector<float> bad_bias(16, 0.0f);
  bad_bias[9] = -std::numeric_limits<float>::infinity();
  expect_error([&] { route(c, logits, 3, bad_bias); }, "bias[expert 9] = -inf is not finite");
}

}  // namespace
}  // namespace pounce::reference
