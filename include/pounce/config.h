// The shape of an expert-parallel MoE layer: every rank of the group builds its layer from the same
// EpConfig (the NCCL layer checks that it does).
#pragma once

#include <cstdint>

namespace pounce {

// What the fused layer supports; check_config() names the first limit a config breaks.
inline constexpr int kMaxRanks = 8;            // one NVLink node
inline constexpr int kMaxLocalExperts = 1024;  // experts per rank
inline constexpr int64_t kMaxHidden = 65536;   // and intermediate; both multiples of 64
inline constexpr int64_t kMaxTokensPerRank = (int64_t(1) << 24) - 1;

struct EpConfig {
  int ranks = 1;                    // P, the expert-parallel group size (1 to 8)
  int experts = 0;                  // E, global; rank r owns experts [r E/P, (r+1) E/P)
  int topk = 0;                     // k, experts per token (1 to E)
  int64_t hidden = 0;               // H, a multiple of 64
  int64_t intermediate = 0;         // I, a multiple of 64
  int64_t max_tokens_per_rank = 0;  // T_max: every buffer is sized from it, never from the routing
  // Routes one rank's experts may receive in a forward: the routed rows every per-rank buffer is sized
  // for (the schedule, the kept gate/up rows, the backward's rows). 0: every route of every rank's T_max
  // tokens, P * T_max * min(k, E/P), which no routing can exceed but which is P times the average at
  // balanced routing. A forward (or backward) whose routing sends more to some rank stops before any
  // data moves, on every rank, with an error naming the rank and its routes.
  int64_t max_routes_per_rank = 0;

  int local_experts() const { return experts / ranks; }
  int first_local_expert(int rank) const { return rank * local_experts(); }
};

// Throws pounce::Error naming the first problem: ranks outside [1, kMaxRanks], experts not divisible by
// ranks or more than kMaxLocalExperts per rank, topk outside [1, experts], hidden or intermediate not a
// positive multiple of 64 or above kMaxHidden, max_tokens_per_rank outside [0, kMaxTokensPerRank],
// max_routes_per_rank negative.
void check_config(const EpConfig& config);

}  // namespace pounce
