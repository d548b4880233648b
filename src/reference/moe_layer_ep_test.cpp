#include "reference/moe_layer_ep.h"

#include <gtest/gtest.h>

#include "common/testing.h"
#include "reference/moe_layer.h"
#include "reference/synthetic_routing.h"

namespace pounce::reference {
namespace {

struct EpCase {
  int ranks;
  RoutingPattern pattern;
};

void PrintTo(const EpCase& c, std::ostream* out) {
  *out << "P" << c.ranks << "_" << reference::routing_pattern_name(c.pattern);
}

class MoeLayerEpTest : public ::testing::TestWithParam<EpCase> {};

// The EP split (planner + dispatch + per-expert compute + slot combine + weighted sum) must give the
// single-device layer on the concatenated tokens, forward and backward.
TEST_P(MoeLayerEpTest, MatchesSingleDevice) {
  auto rng = testing::fresh_rng();
  const auto [P, pattern] = GetParam();
  EpConfig c{.ranks = P, .experts = 16, .topk = 4, .hidden = 64, .intermediate = 64, .max_tokens_per_rank = 40};
  const int64_t H = c.hidden, I = c.intermediate, k = c.topk, E = c.experts;

  std::vector<int64_t> tokens(P);
  std::vector<std::vector<float>> x(P), w(P), dy(P);
  std::vector<std::vector<int32_t>> ids(P);
  std::uniform_int_distribution<int64_t> count(2, c.max_tokens_per_rank);
  for (int r = 0; r < P; ++r) {
    tokens[r] = r == 1 ? 0 : r == 2 ? 1 : count(rng);  // T = 0 and T = 1 ranks when P allows
    x[r] = testing::random_bf16_values(rng, tokens[r] * H);
    dy[r] = testing::random_bf16_values(rng, tokens[r] * H);
    ids[r] = synthetic_topk_ids(pattern, tokens[r], int(E), int(k), rng);
    w[r] = synthetic_topk_weights(tokens[r], int(k), rng);
  }
  const auto w13 = testing::random_bf16_values(rng, E * 2 * I * H, -0.125f, 0.125f);
  const auto w2 = testing::random_bf16_values(rng, E * H * I, -0.125f, 0.125f);

  std::vector<EpRankInputs> in(P);
  for (int r = 0; r < P; ++r) in[r] = {tokens[r], x[r], ids[r], w[r], dy[r]};
  const auto ep = moe_layer_ep(c, in, w13, w2, /*with_backward=*/true);

  // Single device on all tokens, rank-major.
  std::vector<float> x_all, w_all, dy_all;
  std::vector<int32_t> ids_all;
  for (int r = 0; r < P; ++r) {
    x_all.insert(x_all.end(), x[r].begin(), x[r].end());
    w_all.insert(w_all.end(), w[r].begin(), w[r].end());
    dy_all.insert(dy_all.end(), dy[r].begin(), dy[r].end());
    ids_all.insert(ids_all.end(), ids[r].begin(), ids[r].end());
  }
  const int64_t T = int64_t(ids_all.size()) / k;
  const MoeShape shape{.tokens = T, .hidden = H, .intermediate = I, .experts = E, .topk = k};
  const MoeInputs all{x_all, ids_all, w_all, w13, w2};
  const auto y = moe_forward(shape, all);
  const auto g = moe_backward(shape, all, dy_all);

  std::vector<double> y_ep, dx_ep, dtw_ep, dw13_ep, dw2_ep;
  for (int r = 0; r < P; ++r) {
    ASSERT_EQ(int64_t(ep[r].y.size()), tokens[r] * H);
    y_ep.insert(y_ep.end(), ep[r].y.begin(), ep[r].y.end());
    dx_ep.insert(dx_ep.end(), ep[r].dx.begin(), ep[r].dx.end());
    dtw_ep.insert(dtw_ep.end(), ep[r].d_topk_weights.begin(), ep[r].d_topk_weights.end());
    dw13_ep.insert(dw13_ep.end(), ep[r].dw13.begin(), ep[r].dw13.end());
    dw2_ep.insert(dw2_ep.end(), ep[r].dw2.begin(), ep[r].dw2.end());
  }
  EXPECT_LT(testing::relative_l2_error(y_ep, y), 1e-12);
  EXPECT_LT(testing::relative_l2_error(dx_ep, g.dx), 1e-12);
  EXPECT_LT(testing::relative_l2_error(dtw_ep, g.d_topk_weights), 1e-12);
  EXPECT_LT(testing::relative_l2_error(dw13_ep, g.dw13), 1e-12);
  EXPECT_LT(testing::relative_l2_error(dw2_ep, g.dw2), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(Ranks, MoeLayerEpTest,
                         ::testing::Values(EpCase{1, RoutingPattern::kUniform}, EpCase{2, RoutingPattern::kZipf},
                                           EpCase{4, RoutingPattern::kUniform}, EpCase{8, RoutingPattern::kZipf},
                                           EpCase{4, RoutingPattern::kOneExpert},
                                           EpCase{2, RoutingPattern::kHalfEmpty}));

}  // namespace
}  // namespace pounce::reference
