// Minibatch sizing by GEMM waves (docs/design.md §3.4). A minibatch must hold enough routed rows that the
// first GEMM of the expert FFN gives every compute SM at least `waves` tiles:
//   rows >= waves * compute_sms * block_m / tiles_per_row_block,   tiles_per_row_block = ceil(n_gemm1 / block_n)
// with n_gemm1 = 2 * intermediate (gate and up). Fewer rows leave SMs idle in the GEMM's tail; many
// more rows delay the first tile (it waits for the whole minibatch to be dispatched). The fused layer's
// default minibatch is minibatch_rows_for() its GEMM CTAs.
#pragma once

#include <cstdint>

#include "common/tiles.h"

namespace pounce::planner {

struct WaveModel {
  int compute_sms = 0;
  int block_m = kBlockM;
  int block_n = kBlockN;
  int waves = 2;
};

// Minimum minibatch rows for GEMM1 with N = 2 * intermediate. Throws pounce::Error on non-positive
// arguments.
int64_t min_minibatch_rows(const WaveModel& model, int64_t intermediate);

// min_minibatch_rows rounded up to whole m-blocks of model.block_m rows.
int64_t minibatch_rows_for(const WaveModel& model, int64_t intermediate);

}  // namespace pounce::planner
