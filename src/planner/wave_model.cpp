#include "planner/wave_model.h"

#include "common/require.h"

namespace pounce::planner {

int64_t min_minibatch_rows(const WaveModel& m, int64_t intermediate) {
  POUNCE_REQUIRE(m.compute_sms > 0 && m.block_m > 0 && m.block_n > 0 && m.waves > 0,
                 "wave model: compute_sms = ", m.compute_sms, ", block_m = ", m.block_m, ", block_n = ", m.block_n,
                 ", waves = ", m.waves, " must all be positive");
  POUNCE_REQUIRE(intermediate > 0, "wave model: intermediate = ", intermediate, " must be positive");
  // A partial last n-block is a tile too: GEMM1's N = 2 * intermediate need not be a multiple of block_n.
  const int64_t tiles_per_row_block = (2 * intermediate + m.block_n - 1) / m.block_n;
  const int64_t numerator = int64_t(m.waves) * m.compute_sms * m.block_m;
  return (numerator + tiles_per_row_block - 1) / tiles_per_row_block;
}

int64_t minibatch_rows_for(const WaveModel& m, int64_t intermediate) {
  const int64_t rows = min_minibatch_rows(m, intermediate);
  return (rows + m.block_m - 1) / m.block_m * m.block_m;
}

}  // namespace pounce::planner
