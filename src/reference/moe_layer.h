// Host reference of the MoE layer, forward and backward: the ground truth every kernel is tested
// against. Plain loops, double accumulation, no cleverness.
//
// Per token t and route k (expert e = topk_ids[t,k], weight w = topk_weights[t,k]):
//   [g, u] = W13[e] . x[t]            gate/up rows interleaved in groups of 8 (see w13_row below)
//   a      = silu(g) * u              silu(g) = g / (1 + exp(-g))          a is the "hidden" row [I]
//   o      = W2[e] . a                [H]
//   y[t]  += w * o                    summed over k in order 0..topk-1
// Backward from dy[T,H]:
//   d_topk_weights[t,k] = <dy[t], o> ,  da = w * W2[e]^T dy[t],  dW2[e] += w * dy[t] (x) a
//   du = da * silu(g),  dg = da * u * silu'(g),  dx[t] += W13[e]^T [dg, du],  dW13[e] += [dg, du] (x) x[t]
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pounce::reference {

struct MoeShape {
  int64_t tokens = 0;        // T
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I (per expert; W13 has 2I rows)
  int64_t experts = 0;       // E
  int64_t topk = 0;          // k
};

// Row of W13[e] ([2I, H]) that holds gate row i (is_up = false) or up row i (is_up = true):
// rows 16j..16j+7 are gate rows 8j..8j+7 and rows 16j+8..16j+15 are up rows 8j..8j+7, so one
// 8-column chunk of a GEMM accumulator holds gate values and the next chunk the matching up values.
inline int64_t w13_row(int64_t i, bool is_up) { return (i / 8) * 16 + (is_up ? 8 : 0) + i % 8; }

// Builds interleaved W13 [E, 2I, H] from separate gate [E, I, H] and up [E, I, H].
std::vector<float> interleave_w13(std::span<const float> gate, std::span<const float> up, int64_t experts,
                                  int64_t intermediate, int64_t hidden);

struct MoeInputs {
  std::span<const float> x;             // [T, H]
  std::span<const int32_t> topk_ids;    // [T, k], each in [0, E), distinct within a token
  std::span<const float> topk_weights;  // [T, k]
  std::span<const float> w13;           // [E, 2I, H], interleaved
  std::span<const float> w2;            // [E, H, I]
};

// Throws pounce::Error naming the problem: span sizes that do not match the shape, expert ids out of
// range, an expert listed twice in one token's top-k.
void validate(const MoeShape& shape, const MoeInputs& in);

std::vector<double> moe_forward(const MoeShape& shape, const MoeInputs& in);  // y [T, H]

// The per-route intermediates of the forward, for tests of kernels that produce them.
struct MoeRouteActivations {
  std::vector<double> hidden;  // [T, k, I]  a = silu(g) * u
  std::vector<double> out;     // [T, k, H]  o = W2[e] . a (before the router weight)
};
MoeRouteActivations moe_route_activations(const MoeShape& shape, const MoeInputs& in);

struct MoeGradients {
  std::vector<double> dx;              // [T, H]
  std::vector<double> dw13;            // [E, 2I, H], interleaved like w13
  std::vector<double> dw2;             // [E, H, I]
  std::vector<double> d_topk_weights;  // [T, k]
  // [T, k]: sum_i |da_i a_i| of each route's dot <da, a>, what its rounding error scales with (the dot
  // itself may cancel to nearly zero): measure router-weight gradients against it.
  std::vector<double> d_topk_scale;
};
MoeGradients moe_backward(const MoeShape& shape, const MoeInputs& in, std::span<const float> dy);

}  // namespace pounce::reference
