// Work order of the grouped GEMM. A work item is a pair of consecutive m-blocks (counted over all
// experts) times one n-block; the two CTAs of a cluster compute it, CTA rank r the tile of m-block
// 2 * pair + r. When both m-blocks belong to one expert the CTAs need the same B tile and share it
// (each loads half and multicasts it); a pair that straddles two experts loads B twice.
//
// Items come in bands of band_pairs pairs walked m-fastest: the ~66 items in flight share a few B
// n-blocks and a band of A rows instead of streaming all of either through L2.
#pragma once

#include <cstdint>

namespace pounce::gemm {

struct PairScheduler {
  static constexpr int32_t kBlockM = 128;

  const int32_t* expert_offsets;  // [experts + 1], multiples of kBlockM
  int32_t experts;
  int32_t n_blocks;
  int32_t m_blocks;  // expert_offsets[experts] / kBlockM
  int32_t band_pairs;

  __device__ int32_t pairs() const { return (m_blocks + 1) / 2; }
  __device__ int64_t total_items() const { return int64_t(pairs()) * n_blocks; }

  // The expert owning m_block < m_blocks: the last expert starting at or before it (empty experts share
  // their start with the next one, and "last" skips them).
  __device__ int32_t expert_of(int32_t m_block) const {
    int32_t lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int32_t mid = (lo + hi + 1) / 2;
      if (expert_offsets[mid] / kBlockM <= m_block) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  struct Item {
    int32_t pair, n_block;
  };
  // item < total_items().
  __device__ Item decode(int64_t item) const {
    const int64_t per_band = int64_t(band_pairs) * n_blocks;
    const int32_t band = int32_t(item / per_band);
    const int32_t first = band * band_pairs;
    const int32_t width = pairs() - first < band_pairs ? pairs() - first : band_pairs;  // the last band may be narrower
    const int32_t in_band = int32_t(item - band * per_band);
    return {first + in_band % width, in_band / width};
  }
};

}  // namespace pounce::gemm
