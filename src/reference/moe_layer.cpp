#include "reference/moe_layer.h"

#include <algorithm>
#include <cmath>

#include "common/require.h"
#include "reference/stable_math.h"

namespace pounce::reference {
namespace {

void require_size(const char* name, size_t got, int64_t want, const char* formula) {
  POUNCE_REQUIRE(got == static_cast<size_t>(want), name, " has ", got, " elements, expected ", formula, " = ", want);
}

void validate_shape(const MoeShape& s) {
  POUNCE_REQUIRE(s.tokens >= 0, "MoeShape.tokens = ", s.tokens, " must be >= 0");
  POUNCE_REQUIRE(s.hidden > 0, "MoeShape.hidden = ", s.hidden, " must be > 0");
  POUNCE_REQUIRE(s.intermediate > 0 && s.intermediate % 8 == 0, "MoeShape.intermediate = ", s.intermediate,
                 " must be a positive multiple of 8 (W13 interleaves gate/up rows in groups of 8)");
  POUNCE_REQUIRE(s.experts > 0, "MoeShape.experts = ", s.experts, " must be > 0");
  POUNCE_REQUIRE(s.topk >= 1 && s.topk <= s.experts, "MoeShape.topk = ", s.topk,
                 " must be in [1, experts = ", s.experts, "]");
}

// Forward of one route (token t through expert e), kept whole because the backward needs g and u.
struct RouteForward {
  std::vector<double> g, u, a;  // [I] each
};

void route_hidden(const MoeShape& s, const MoeInputs& in, int64_t t, int64_t e, RouteForward& r) {
  const int64_t H = s.hidden, I = s.intermediate;
  const float* x = &in.x[t * H];
  const float* w13 = &in.w13[e * 2 * I * H];
  r.g.assign(I, 0.0);
  r.u.assign(I, 0.0);
  r.a.assign(I, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    const float* gate_row = w13 + w13_row(i, false) * H;
    const float* up_row = w13 + w13_row(i, true) * H;
    double g = 0, u = 0;
    for (int64_t h = 0; h < H; ++h) {
      g += double(gate_row[h]) * x[h];
      u += double(up_row[h]) * x[h];
    }
    r.g[i] = g;
    r.u[i] = u;
    r.a[i] = g * stable_sigmoid(g) * u;
  }
}

// o = W2[e] . a, written to out[0, H).
void route_out(const MoeShape& s, const MoeInputs& in, int64_t e, const std::vector<double>& a, double* out) {
  const int64_t H = s.hidden, I = s.intermediate;
  const float* w2 = &in.w2[e * H * I];
  for (int64_t h = 0; h < H; ++h) {
    double o = 0;
    for (int64_t i = 0; i < I; ++i) o += double(w2[h * I + i]) * a[i];
    out[h] = o;
  }
}

}  // namespace

std::vector<float> interleave_w13(std::span<const float> gate, std::span<const float> up, int64_t experts,
                                  int64_t intermediate, int64_t hidden) {
  POUNCE_REQUIRE(experts > 0 && hidden > 0, "interleave_w13: experts = ", experts, " and hidden = ", hidden,
                 " must be > 0");
  POUNCE_REQUIRE(intermediate > 0 && intermediate % 8 == 0, "interleave_w13: intermediate = ", intermediate,
                 " must be a positive multiple of 8");
  const int64_t matrix = intermediate * hidden;
  require_size("gate", gate.size(), experts * matrix, "E*I*H");
  require_size("up", up.size(), experts * matrix, "E*I*H");
  std::vector<float> w13(2 * experts * matrix);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t i = 0; i < intermediate; ++i) {
      for (int64_t h = 0; h < hidden; ++h) {
        const int64_t src = e * matrix + i * hidden + h;
        w13[(e * 2 * intermediate + w13_row(i, false)) * hidden + h] = gate[src];
        w13[(e * 2 * intermediate + w13_row(i, true)) * hidden + h] = up[src];
      }
    }
  }
  return w13;
}

void validate(const MoeShape& shape, const MoeInputs& in) {
  validate_shape(shape);
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.intermediate, E = shape.experts, K = shape.topk;
  require_size("x", in.x.size(), T * H, "T*H");
  require_size("topk_ids", in.topk_ids.size(), T * K, "T*k");
  require_size("topk_weights", in.topk_weights.size(), T * K, "T*k");
  require_size("w13", in.w13.size(), E * 2 * I * H, "E*2I*H");
  require_size("w2", in.w2.size(), E * H * I, "E*H*I");
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* ids = &in.topk_ids[t * K];
    for (int64_t k = 0; k < K; ++k) {
      POUNCE_REQUIRE(ids[k] >= 0 && ids[k] < E, "topk_ids[token ", t, "][k ", k, "] = ", ids[k],
                     " is out of range [0, ", E, ")");
      for (int64_t earlier = 0; earlier < k; ++earlier) {
        POUNCE_REQUIRE(ids[earlier] != ids[k], "token ", t, " lists expert ", ids[k], " twice (k ", earlier, " and k ",
                       k, ")");
      }
    }
  }
}

MoeRouteActivations moe_route_activations(const MoeShape& shape, const MoeInputs& in) {
  validate(shape, in);
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.intermediate, K = shape.topk;
  MoeRouteActivations act;
  act.hidden.resize(T * K * I);
  act.out.resize(T * K * H);
  RouteForward r;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t route = t * K + k;
      const int64_t e = in.topk_ids[route];
      route_hidden(shape, in, t, e, r);
      std::copy(r.a.begin(), r.a.end(), act.hidden.begin() + route * I);
      route_out(shape, in, e, r.a, &act.out[route * H]);
    }
  }
  return act;
}

std::vector<double> moe_forward(const MoeShape& shape, const MoeInputs& in) {
  validate(shape, in);
  const int64_t T = shape.tokens, H = shape.hidden, K = shape.topk;
  std::vector<double> y(T * H, 0.0), o(H);
  RouteForward r;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = in.topk_ids[t * K + k];
      const double w = in.topk_weights[t * K + k];
      route_hidden(shape, in, t, e, r);
      route_out(shape, in, e, r.a, o.data());
      for (int64_t h = 0; h < H; ++h) y[t * H + h] += w * o[h];
    }
  }
  return y;
}

MoeGradients moe_backward(const MoeShape& shape, const MoeInputs& in, std::span<const float> dy) {
  validate(shape, in);
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.intermediate, E = shape.experts, K = shape.topk;
  require_size("dy", dy.size(), T * H, "T*H");
  MoeGradients grad;
  grad.dx.assign(T * H, 0.0);
  grad.dw13.assign(E * 2 * I * H, 0.0);
  grad.dw2.assign(E * H * I, 0.0);
  grad.d_topk_weights.assign(T * K, 0.0);
  grad.d_topk_scale.assign(T * K, 0.0);

  RouteForward r;
  std::vector<double> da(I), dgu(2 * I);  // dgu is interleaved like the rows of W13
  for (int64_t t = 0; t < T; ++t) {
    const float* x = &in.x[t * H];
    const float* dyt = &dy[t * H];
    for (int64_t k = 0; k < K; ++k) {
      const int64_t route = t * K + k;
      const int64_t e = in.topk_ids[route];
      const double w = in.topk_weights[route];
      const float* w2 = &in.w2[e * H * I];
      const float* w13 = &in.w13[e * 2 * I * H];
      route_hidden(shape, in, t, e, r);

      // Unscaled W2[e]^T dy first: it gives the router-weight gradient <dy, o> = <W2^T dy, a> as the
      // kernels compute it, without materializing o.
      std::fill(da.begin(), da.end(), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const double d = dyt[h];
        for (int64_t i = 0; i < I; ++i) da[i] += double(w2[h * I + i]) * d;
      }
      double dw = 0, scale = 0;
      for (int64_t i = 0; i < I; ++i) dw += da[i] * r.a[i], scale += std::abs(da[i] * r.a[i]);
      grad.d_topk_weights[route] = dw;
      grad.d_topk_scale[route] = scale;

      double* dw2 = &grad.dw2[e * H * I];
      for (int64_t h = 0; h < H; ++h) {
        const double d = w * dyt[h];
        for (int64_t i = 0; i < I; ++i) dw2[h * I + i] += d * r.a[i];
      }

      // a = silu(g) u with silu(g) = g s, s = sigmoid(g), silu'(g) = s (1 + g (1 - s)).
      for (int64_t i = 0; i < I; ++i) {
        const double s = stable_sigmoid(r.g[i]);
        const double dai = w * da[i];
        dgu[w13_row(i, false)] = dai * r.u[i] * s * (1.0 + r.g[i] * (1.0 - s));
        dgu[w13_row(i, true)] = dai * r.g[i] * s;
      }

      double* dx = &grad.dx[t * H];
      double* dw13 = &grad.dw13[e * 2 * I * H];
      for (int64_t row = 0; row < 2 * I; ++row) {
        const double d = dgu[row];
        const float* w13_r = w13 + row * H;
        double* dw13_r = dw13 + row * H;
        for (int64_t h = 0; h < H; ++h) {
          dx[h] += double(w13_r[h]) * d;
          dw13_r[h] += d * x[h];
        }
      }
    }
  }
  return grad;
}

}  // namespace pounce::reference
