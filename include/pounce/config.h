// The shape of an expert-parallel MoE layer: every rank of the group builds its layer from the same
// EpConfig (the NCCL layer checks that it does).
#pragma once

#include <cstdint>

namespace pounce {

struct EpConfig {
  int ranks = 1;                    // P, the expert-parallel group size (1 to 8)
  int experts = 0;                  // E, global; rank r owns experts [r E/P, (r+1) E/P)
  int topk = 0;                     // k, experts per token (1 to E)
  int64_t hidden = 0;               // H, a multiple of 64
  int64_t intermediate = 0;         // I, a multiple of 64
  int64_t max_tokens_per_rank = 0;  // T_max: every buffer is sized from it, never from the routing

  int local_experts() const { return experts / ranks; }
  int first_local_expert(int rank) const { return rank * local_experts(); }
};

}  // namespace pounce
