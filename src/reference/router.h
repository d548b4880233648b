// Router reference: scores from logits, top-k expert selection and routing weights, producing the
// topk_ids / topk_weights the MoE layer consumes. Covers the public model families:
//   softmax scores, plain top-k (Mixtral, Qwen3-MoE);
//   sigmoid scores with a selection-only bias and group-limited routing (DeepSeek-V3 / Kimi K2:
//   n_group groups, the best topk_group groups by the sum of their two best biased scores).
// Deterministic: ties go to the lower expert (or group) index.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pounce::reference {

enum class ScoreFunction { kSoftmax, kSigmoid };

struct RouterConfig {
  int experts = 0;
  int topk = 0;
  ScoreFunction score = ScoreFunction::kSoftmax;
  int n_group = 1;              // experts split into n_group equal groups; 1 = no group limit
  int topk_group = 1;           // groups kept per token (ignored when n_group == 1)
  bool normalize = true;        // weights divided by the sum of the selected scores
  float scaling_factor = 1.0f;  // applied after normalization (DeepSeek-V3: 2.5)
};

struct RouterOutput {
  std::vector<int32_t> topk_ids;    // [T, topk], in descending order of selection score
  std::vector<float> topk_weights;  // [T, topk]
};

// logits [T, E]. bias: empty, or [E] added to the scores for selection only (weights use the
// unbiased scores). Group score: max score in the group for softmax, sum of the top two for sigmoid.
// Throws pounce::Error on inconsistent config (topk > experts, experts % n_group != 0,
// topk_group > n_group, fewer than topk experts in the kept groups, bad span sizes).
RouterOutput route(const RouterConfig& config, std::span<const float> logits, int64_t tokens,
                   std::span<const float> bias = {});

}  // namespace pounce::reference
