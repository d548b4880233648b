// Tests of the host MoE reference. The reference is checked against code written differently:
// a dense formulation (every expert applied to every token, scaled by a 0-or-weight coefficient,
// with separate gate/up matrices) for forward and backward, and finite differences of <dy, y>.
#include "reference/moe_layer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/require.h"
#include "common/testing.h"

namespace pounce::reference {
namespace {

using pounce::testing::fresh_rng;
using pounce::testing::random_bf16_values;
using pounce::testing::relative_l2_error;

using pounce::testing::expect_error;

// One layer's inputs, bf16-representable, with distinct random experts per token.
struct Problem {
  MoeShape shape;
  std::vector<float> x, topk_weights, w13, w2;
  std::vector<int32_t> topk_ids;
  MoeInputs inputs() const { return {x, topk_ids, topk_weights, w13, w2}; }
};

Problem random_problem(std::mt19937_64& rng, const MoeShape& shape) {
  const auto [T, H, I, E, K] = shape;
  Problem p;
  p.shape = shape;
  // Weight scales keep gate values O(1), where SiLU is far from linear.
  const float s13 = 2.0f / std::sqrt(float(H)), s2 = 2.0f / std::sqrt(float(I));
  p.x = random_bf16_values(rng, T * H);
  p.w13 = random_bf16_values(rng, E * 2 * I * H, -s13, s13);
  p.w2 = random_bf16_values(rng, E * H * I, -s2, s2);
  p.topk_weights = random_bf16_values(rng, T * K, 0.0f, 1.0f);
  std::vector<int32_t> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    p.topk_ids.insert(p.topk_ids.end(), experts.begin(), experts.begin() + K);
  }
  return p;
}

// ---- the dense formulation -----------------------------------------------------------------------

// Row `row` of W13[e] read by the layout rule stated as its inverse: row 16j+r is gate row 8j+r for
// r < 8 and up row 8j+r-8 otherwise.
struct W13RowMeaning {
  bool is_up;
  int64_t i;
};
W13RowMeaning w13_row_meaning(int64_t row) {
  const int64_t j = row / 16, r = row % 16;
  return r < 8 ? W13RowMeaning{false, 8 * j + r} : W13RowMeaning{true, 8 * j + r - 8};
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }
// d/dg [g / (1 + e^-g)], by the quotient rule.
double silu_grad(double g) {
  const double z = std::exp(-g);
  return (1.0 + z + g * z) / ((1.0 + z) * (1.0 + z));
}

struct Dense {
  const Problem& p;
  int64_t T, H, I, E, K;
  std::vector<double> gate, up, w2;  // [E, I, H], [E, I, H], [E, H, I]
  std::vector<double> coef;          // [T, E]: the token's weight for e, or 0 when e is not in its top-k
  std::vector<int64_t> slot;         // [T, E]: k of e in the token's top-k, or -1

  explicit Dense(const Problem& problem)
      : p(problem),
        T(p.shape.tokens),
        H(p.shape.hidden),
        I(p.shape.intermediate),
        E(p.shape.experts),
        K(p.shape.topk),
        gate(E * I * H),
        up(E * I * H),
        w2(p.w2.begin(), p.w2.end()),
        coef(T * E, 0.0),
        slot(T * E, -1) {
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t row = 0; row < 2 * I; ++row) {
        const W13RowMeaning m = w13_row_meaning(row);
        for (int64_t h = 0; h < H; ++h) {
          (m.is_up ? up : gate)[(e * I + m.i) * H + h] = p.w13[(e * 2 * I + row) * H + h];
        }
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        coef[t * E + p.topk_ids[t * K + k]] = p.topk_weights[t * K + k];
        slot[t * E + p.topk_ids[t * K + k]] = k;
      }
    }
  }

  double g(int64_t e, int64_t t, int64_t i) const { return dot(&gate[(e * I + i) * H], t); }
  double u(int64_t e, int64_t t, int64_t i) const { return dot(&up[(e * I + i) * H], t); }
  double dot(const double* row, int64_t t) const {
    double s = 0;
    for (int64_t h = 0; h < H; ++h) s += row[h] * p.x[t * H + h];
    return s;
  }
  std::vector<double> hidden(int64_t e, int64_t t) const {
    std::vector<double> a(I);
    for (int64_t i = 0; i < I; ++i) a[i] = silu(g(e, t, i)) * u(e, t, i);
    return a;
  }
  std::vector<double> ffn(int64_t e, int64_t t) const {
    const std::vector<double> a = hidden(e, t);
    std::vector<double> o(H, 0.0);
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t h = 0; h < H; ++h) o[h] += w2[(e * H + h) * I + i] * a[i];
    }
    return o;
  }

  std::vector<double> forward() const {
    std::vector<double> y(T * H, 0.0);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t t = 0; t < T; ++t) {
        const std::vector<double> o = ffn(e, t);
        for (int64_t h = 0; h < H; ++h) y[t * H + h] += coef[t * E + e] * o[h];
      }
    }
    return y;
  }

  // The chain rule through y[t] = sum_e c_e[t] * W2_e (silu(G_e x) * (U_e x)), all experts densely.
  MoeGradients backward(const std::vector<float>& dy) const {
    MoeGradients d;
    d.dx.assign(T * H, 0.0);
    d.dw13.assign(E * 2 * I * H, 0.0);
    d.dw2.assign(E * H * I, 0.0);
    d.d_topk_weights.assign(T * K, 0.0);
    std::vector<double> dgate(E * I * H, 0.0), dup(E * I * H, 0.0);
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t t = 0; t < T; ++t) {
        const double c = coef[t * E + e];
        const std::vector<double> a = hidden(e, t), o = ffn(e, t);
        if (slot[t * E + e] >= 0) {
          double dc = 0;
          for (int64_t h = 0; h < H; ++h) dc += dy[t * H + h] * o[h];
          d.d_topk_weights[t * K + slot[t * E + e]] = dc;
        }
        for (int64_t i = 0; i < I; ++i) {
          double da = 0;
          for (int64_t h = 0; h < H; ++h) {
            da += c * dy[t * H + h] * w2[(e * H + h) * I + i];
            d.dw2[(e * H + h) * I + i] += c * dy[t * H + h] * a[i];
          }
          const double gi = g(e, t, i), ui = u(e, t, i);
          const double dg = da * ui * silu_grad(gi), du = da * silu(gi);
          for (int64_t h = 0; h < H; ++h) {
            d.dx[t * H + h] += gate[(e * I + i) * H + h] * dg + up[(e * I + i) * H + h] * du;
            dgate[(e * I + i) * H + h] += dg * p.x[t * H + h];
            dup[(e * I + i) * H + h] += du * p.x[t * H + h];
          }
        }
      }
    }
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t row = 0; row < 2 * I; ++row) {
        const W13RowMeaning m = w13_row_meaning(row);
        for (int64_t h = 0; h < H; ++h) {
          d.dw13[(e * 2 * I + row) * H + h] = (m.is_up ? dup : dgate)[(e * I + m.i) * H + h];
        }
      }
    }
    return d;
  }
};

void expect_gradients_near(const MoeGradients& got, const MoeGradients& want, double tol) {
  EXPECT_LT(relative_l2_error(got.dx, want.dx), tol);
  EXPECT_LT(relative_l2_error(got.dw13, want.dw13), tol);
  EXPECT_LT(relative_l2_error(got.dw2, want.dw2), tol);
  EXPECT_LT(relative_l2_error(got.d_topk_weights, want.d_topk_weights), tol);
}

// ---- W13 layout ----------------------------------------------------------------------------------

TEST(W13Layout, RowRule) {
  EXPECT_EQ(w13_row(0, false), 0);
  EXPECT_EQ(w13_row(7, false), 7);
  EXPECT_EQ(w13_row(0, true), 8);
  EXPECT_EQ(w13_row(7, true), 15);
  EXPECT_EQ(w13_row(8, false), 16);
  EXPECT_EQ(w13_row(9, true), 25);
  EXPECT_EQ(w13_row(23, true), 47);
  // A bijection from (i, is_up) onto the 2I rows.
  const int64_t I = 64;
  std::vector<int> hits(2 * I, 0);
  for (int64_t i = 0; i < I; ++i) {
    for (bool is_up : {false, true}) {
      const int64_t row = w13_row(i, is_up);
      ASSERT_GE(row, 0);
      ASSERT_LT(row, 2 * I);
      ++hits[row];
      EXPECT_EQ(w13_row_meaning(row).i, i);
      EXPECT_EQ(w13_row_meaning(row).is_up, is_up);
    }
  }
  EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int n) { return n == 1; }));
}

TEST(W13Layout, InterleavePlacesEveryRow) {
  const int64_t E = 3, I = 24, H = 5;
  // Values that name their origin: gate (e, i, h) -> +(1 + e*1000 + i*10 + h), up -> the negative.
  std::vector<float> gate(E * I * H), up(E * I * H);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        gate[(e * I + i) * H + h] = float(1 + e * 1000 + i * 10 + h);
        up[(e * I + i) * H + h] = -float(1 + e * 1000 + i * 10 + h);
      }
    }
  }
  const std::vector<float> w13 = interleave_w13(gate, up, E, I, H);
  ASSERT_EQ(w13.size(), size_t(E * 2 * I * H));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t row = 0; row < 2 * I; ++row) {
      const int64_t j = row / 16, r = row % 16;
      const bool is_up = r >= 8;
      const int64_t i = is_up ? 8 * j + r - 8 : 8 * j + r;
      for (int64_t h = 0; h < H; ++h) {
        const float want = (is_up ? -1.0f : 1.0f) * float(1 + e * 1000 + i * 10 + h);
        EXPECT_EQ(w13[(e * 2 * I + row) * H + h], want) << "e " << e << " row " << row << " h " << h;
      }
    }
  }
}

TEST(W13Layout, InterleaveRejectsBadShapes) {
  std::vector<float> g(2 * 12 * 4), u(2 * 12 * 4);
  expect_error([&] { interleave_w13(g, u, 2, 12, 4); }, "intermediate = 12 must be a positive multiple of 8");
  std::vector<float> g16(2 * 16 * 4), u16(2 * 16 * 4 - 1);
  expect_error([&] { interleave_w13(g16, u16, 2, 16, 4); }, "up has 127 elements, expected E*I*H = 128");
}

// ---- forward ---------------------------------------------------------------------------------------

TEST(MoeForward, MatchesDenseFormulation) {
  auto rng = fresh_rng();
  // A regular shape and an odd hidden size (the reference takes any H; only I is tied to the layout).
  for (const MoeShape shape : {MoeShape{64, 128, 64, 8, 3}, MoeShape{37, 40, 24, 5, 2}}) {
    const Problem p = random_problem(rng, shape);
    const std::vector<double> y = moe_forward(p.shape, p.inputs());
    const std::vector<double> want = Dense(p).forward();
    EXPECT_LT(relative_l2_error(y, want), 1e-12) << "T " << shape.tokens << " H " << shape.hidden;
  }
}

TEST(MoeForward, RouteActivationsAgreeWithForward) {
  auto rng = fresh_rng();
  const Problem p = random_problem(rng, {19, 48, 32, 6, 3});
  const auto [T, H, I, E, K] = p.shape;
  const MoeRouteActivations act = moe_route_activations(p.shape, p.inputs());
  ASSERT_EQ(act.hidden.size(), size_t(T * K * I));
  ASSERT_EQ(act.out.size(), size_t(T * K * H));

  const Dense dense(p);
  std::vector<double> want_hidden, want_out;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = p.topk_ids[t * K + k];
      const std::vector<double> a = dense.hidden(e, t), o = dense.ffn(e, t);
      want_hidden.insert(want_hidden.end(), a.begin(), a.end());
      want_out.insert(want_out.end(), o.begin(), o.end());
    }
  }
  EXPECT_LT(relative_l2_error(act.hidden, want_hidden), 1e-12);
  EXPECT_LT(relative_l2_error(act.out, want_out), 1e-12);

  // y[t] = sum_k w[t,k] * out[t,k], in k order.
  std::vector<double> sum(T * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t h = 0; h < H; ++h) sum[t * H + h] += p.topk_weights[t * K + k] * act.out[(t * K + k) * H + h];
    }
  }
  EXPECT_LT(relative_l2_error(moe_forward(p.shape, p.inputs()), sum), 1e-15);
}

// ---- backward --------------------------------------------------------------------------------------

TEST(MoeBackward, MatchesDenseFormulation) {
  auto rng = fresh_rng();
  for (const MoeShape shape : {MoeShape{48, 64, 32, 8, 3}, MoeShape{21, 40, 24, 5, 2}}) {
    const Problem p = random_problem(rng, shape);
    const std::vector<float> dy = random_bf16_values(rng, shape.tokens * shape.hidden);
    SCOPED_TRACE("T " + std::to_string(shape.tokens) + " H " + std::to_string(shape.hidden));
    expect_gradients_near(moe_backward(p.shape, p.inputs(), dy), Dense(p).backward(dy), 1e-12);
  }
}

// L = <dy, y>, in double.
double loss(const Problem& p, const std::vector<float>& dy) {
  const std::vector<double> y = moe_forward(p.shape, p.inputs());
  double l = 0;
  for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
  return l;
}

// Central difference of L in param[i] with step delta (the step actually taken, should saved +- delta
// not be representable in float).
double central_difference(Problem& p, std::vector<float>& param, size_t i, double delta, const std::vector<float>& dy) {
  const float saved = param[i];
  const float plus = float(saved + delta), minus = float(saved - delta);
  param[i] = plus;
  const double l_plus = loss(p, dy);
  param[i] = minus;
  const double l_minus = loss(p, dy);
  param[i] = saved;
  return (l_plus - l_minus) / (double(plus) - double(minus));
}

// Checks every entry of `param` (a member of p) against finite differences of L. A plain central
// difference with step 2^-8 is off by about delta^2 * f'''/6, ~1e-5 relative here (SiLU's curvature),
// so it is Richardson-extrapolated with step 2^-9, which cancels the delta^2 term. Each entry's error is
// relative to max(|analytic|, 1e-3 * the tensor's largest |gradient|), so entries whose gradient is
// (near) zero are held to the tensor's scale rather than to their own.
void check_finite_differences(Problem& p, std::vector<float>& param, const std::vector<double>& analytic,
                              const std::vector<float>& dy, const char* name) {
  ASSERT_EQ(param.size(), analytic.size()) << name;
  double largest = 0;
  for (double g : analytic) largest = std::max(largest, std::abs(g));
  ASSERT_GT(largest, 0) << name;
  const double delta = std::ldexp(1.0, -8);
  double worst = 0;
  for (size_t i = 0; i < param.size(); ++i) {
    const double coarse = central_difference(p, param, i, delta, dy);
    const double fine = central_difference(p, param, i, delta / 2, dy);
    const double numeric = (4 * fine - coarse) / 3;
    const double err = std::abs(numeric - analytic[i]) / std::max(std::abs(analytic[i]), 1e-3 * largest);
    worst = std::max(worst, err);
    EXPECT_LT(err, 1e-6) << name << "[" << i << "]: analytic " << analytic[i] << ", numeric " << numeric;
  }
  std::printf("[ info     ] %s: worst relative finite-difference error %.3g\n", name, worst);
}

TEST(MoeBackward, FiniteDifferences) {
  auto rng = fresh_rng();
  Problem p = random_problem(rng, {3, 24, 16, 4, 2});
  const std::vector<float> dy = random_bf16_values(rng, 3 * 24);
  const MoeGradients grad = moe_backward(p.shape, p.inputs(), dy);
  check_finite_differences(p, p.x, grad.dx, dy, "dx");
  check_finite_differences(p, p.w13, grad.dw13, dy, "dw13");
  check_finite_differences(p, p.w2, grad.dw2, dy, "dw2");
  check_finite_differences(p, p.topk_weights, grad.d_topk_weights, dy, "d_topk_weights");
}

// ---- edge cases ------------------------------------------------------------------------------------

TEST(MoeEdgeCases, NoTokens) {
  auto rng = fresh_rng();
  const Problem p = random_problem(rng, {0, 32, 16, 4, 2});
  EXPECT_TRUE(moe_forward(p.shape, p.inputs()).empty());
  const MoeRouteActivations act = moe_route_activations(p.shape, p.inputs());
  EXPECT_TRUE(act.hidden.empty());
  EXPECT_TRUE(act.out.empty());
  const MoeGradients grad = moe_backward(p.shape, p.inputs(), {});
  EXPECT_TRUE(grad.dx.empty());
  EXPECT_TRUE(grad.d_topk_weights.empty());
  ASSERT_EQ(grad.dw13.size(), p.w13.size());
  ASSERT_EQ(grad.dw2.size(), p.w2.size());
  EXPECT_TRUE(std::all_of(grad.dw13.begin(), grad.dw13.end(), [](double v) { return v == 0; }));
  EXPECT_TRUE(std::all_of(grad.dw2.begin(), grad.dw2.end(), [](double v) { return v == 0; }));
}

TEST(MoeEdgeCases, OneTokenTopOne) {
  auto rng = fresh_rng();
  const Problem p = random_problem(rng, {1, 64, 32, 4, 1});
  const std::vector<float> dy = random_bf16_values(rng, 64);
  const Dense dense(p);
  EXPECT_LT(relative_l2_error(moe_forward(p.shape, p.inputs()), dense.forward()), 1e-12);
  expect_gradients_near(moe_backward(p.shape, p.inputs(), dy), dense.backward(dy), 1e-12);
}

TEST(MoeEdgeCases, ZeroWeightTokens) {
  auto rng = fresh_rng();
  Problem p = random_problem(rng, {8, 32, 16, 4, 2});
  const auto [T, H, I, E, K] = p.shape;
  // Tokens 2 and 5 have all router weights 0; token 6 only its second.
  for (int64_t k = 0; k < K; ++k) p.topk_weights[2 * K + k] = p.topk_weights[5 * K + k] = 0.0f;
  p.topk_weights[6 * K + 1] = 0.0f;
  const std::vector<float> dy = random_bf16_values(rng, T * H);

  const std::vector<double> y = moe_forward(p.shape, p.inputs());
  const MoeGradients grad = moe_backward(p.shape, p.inputs(), dy);
  const MoeRouteActivations act = moe_route_activations(p.shape, p.inputs());
  for (int64_t t : {2, 5}) {
    for (int64_t h = 0; h < H; ++h) {
      EXPECT_EQ(y[t * H + h], 0.0) << "t " << t;
      EXPECT_EQ(grad.dx[t * H + h], 0.0) << "t " << t;
    }
  }
  // The router-weight gradient <dy, out> does not depend on the weight itself.
  for (int64_t t : {2, 5, 6}) {
    for (int64_t k = 0; k < K; ++k) {
      double want = 0;
      for (int64_t h = 0; h < H; ++h) want += dy[t * H + h] * act.out[(t * K + k) * H + h];
      EXPECT_NEAR(grad.d_topk_weights[t * K + k], want, 1e-12 * std::abs(want)) << "t " << t << " k " << k;
      EXPECT_NE(grad.d_topk_weights[t * K + k], 0.0);
    }
  }
  const Dense dense(p);
  EXPECT_LT(relative_l2_error(y, dense.forward()), 1e-12);
  expect_gradients_near(grad, dense.backward(dy), 1e-12);
}

// ---- validation ------------------------------------------------------------------------------------

TEST(MoeValidate, AcceptsValidInputs) {
  auto rng = fresh_rng();
  const Problem p = random_problem(rng, {5, 16, 8, 4, 4});
  EXPECT_NO_THROW(validate(p.shape, p.inputs()));
}

TEST(MoeValidate, RejectsWrongSpanSizes) {
  auto rng = fresh_rng();
  const Problem good = random_problem(rng, {8, 16, 8, 4, 2});
  {
    Problem p = good;
    p.x.resize(100);
    expect_error([&] { validate(p.shape, p.inputs()); }, "x has 100 elements, expected T*H = 128");
  }
  {
    Problem p = good;
    p.topk_ids.pop_back();
    expect_error([&] { validate(p.shape, p.inputs()); }, "topk_ids has 15 elements, expected T*k = 16");
  }
  {
    Problem p = good;
    p.topk_weights.push_back(0.5f);
    expect_error([&] { validate(p.shape, p.inputs()); }, "topk_weights has 17 elements, expected T*k = 16");
  }
  {
    Problem p = good;
    p.w13.resize(4 * 8 * 16);
    expect_error([&] { validate(p.shape, p.inputs()); }, "w13 has 512 elements, expected E*2I*H = 1024");
  }
  {
    Problem p = good;
    p.w2.clear();
    expect_error([&] { validate(p.shape, p.inputs()); }, "w2 has 0 elements, expected E*H*I = 512");
  }
  const std::vector<float> short_dy(8 * 16 - 1);
  expect_error([&] { moe_backward(good.shape, good.inputs(), short_dy); }, "dy has 127 elements, expected T*H = 128");
}

TEST(MoeValidate, RejectsExpertIdsOutOfRange) {
  auto rng = fresh_rng();
  Problem p = random_problem(rng, {8, 16, 8, 4, 3});
  const int32_t saved = p.topk_ids[5 * 3 + 2];
  p.topk_ids[5 * 3 + 2] = -1;
  expect_error([&] { validate(p.shape, p.inputs()); }, "topk_ids[token 5][k 2] = -1 is out of range [0, 4)");
  p.topk_ids[5 * 3 + 2] = 4;
  expect_error([&] { moe_forward(p.shape, p.inputs()); }, "topk_ids[token 5][k 2] = 4 is out of range [0, 4)");
  p.topk_ids[5 * 3 + 2] = saved;
  p.topk_ids[0] = 300;
  expect_error([&] { moe_route_activations(p.shape, p.inputs()); },
               "topk_ids[token 0][k 0] = 300 is out of range [0, 4)");
}

TEST(MoeValidate, RejectsDuplicateExpertInToken) {
  auto rng = fresh_rng();
  const Problem good = random_problem(rng, {6, 16, 8, 8, 5});
  const std::vector<float> dy(6 * 16, 1.0f);
  {
    Problem p = good;
    p.topk_ids[3 * 5 + 4] = p.topk_ids[3 * 5 + 1];
    const std::string expert = std::to_string(p.topk_ids[3 * 5 + 1]);
    expect_error([&] { moe_backward(p.shape, p.inputs(), dy); },
                 "token 3 lists expert " + expert + " twice (k 1 and k 4)");
  }
  {
    Problem p = good;
    p.topk_ids[1] = p.topk_ids[0];
    const std::string expert = std::to_string(p.topk_ids[0]);
    expect_error([&] { validate(p.shape, p.inputs()); }, "token 0 lists expert " + expert + " twice (k 0 and k 1)");
  }
}

TEST(MoeValidate, RejectsBadShapes) {
  auto rng = fresh_rng();
  const Problem good = random_problem(rng, {2, 16, 8, 4, 2});
  MoeShape s = good.shape;
  s.intermediate = 12;
  expect_error([&] { validate(s, good.inputs()); }, "intermediate = 12 must be a positive multiple of 8");
  s = good.shape;
  s.topk = 5;
  expect_error([&] { validate(s, good.inputs()); }, "topk = 5 must be in [1, experts = 4]");
  s = good.shape;
  s.tokens = -1;
  expect_error([&] { validate(s, good.inputs()); }, "tokens = -1 must be >= 0");
  s = good.shape;
  s.hidden = 0;
  expect_error([&] { validate(s, good.inputs()); }, "hidden = 0 must be > 0");
}

}  // namespace
}  // namespace pounce::reference
