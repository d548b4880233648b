// Test-only access to a FusedMoe's internals: fault injection that the public options do not offer.
#pragma once

#include "moe/fused_layer.h"
#include "pounce/fused_moe.h"

namespace pounce::moe {

struct LayerTesting {
  // From the next forward on, `rank`'s CTAs move no rows (neither the opening nor communication items):
  // its GEMMs and the other ranks' sums wait for rows that never come.
  static void stall_rank(FusedMoe& layer, int rank) { layer.layer_->stall_rank(rank); }
};

}  // namespace pounce::moe
