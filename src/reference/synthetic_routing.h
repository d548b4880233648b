// Synthetic routings for tests and benchmarks: the expert-load patterns a training run meets, each
// valid by construction (k distinct experts per token).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace pounce::reference {

enum class RoutingPattern {
  kUniform,    // k distinct experts uniformly at random
  kZipf,       // expert popularity ~ 1 / rank^1.2 over a random ranking: a few hot experts
  kOneExpert,  // every token's first choice is one hot expert; the rest uniform
  kHalfEmpty,  // only a random half of the experts receive tokens (needs k <= E/2)
  kBalanced,   // every expert receives floor(T k / E) or ceil(T k / E) routes: the equal-rows case that
               // grouped GEMM benchmarks measure (no padding when T k / E is a multiple of 128)
};

// "uniform", "zipf", "one_expert", "half_empty", "balanced"
RoutingPattern parse_routing_pattern(const std::string& name);
const char* routing_pattern_name(RoutingPattern pattern);

// [tokens, topk] expert ids.
std::vector<int32_t> synthetic_topk_ids(RoutingPattern pattern, int64_t tokens, int experts, int topk,
                                        std::mt19937_64& rng);

// [tokens, topk] positive weights summing to 1 per token (softmax of random logits).
std::vector<float> synthetic_topk_weights(int64_t tokens, int topk, std::mt19937_64& rng);

}  // namespace pounce::reference
