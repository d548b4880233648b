// Tile order of the grouped GEMM. Tiles of one expert are contiguous in the queue (its weights stay
// hot in L2); inside an expert, bands of up to band_m_blocks m-blocks are walked m-fastest, so the
// ~132 tiles in flight share a few B n-blocks and a band of A rows instead of streaming all of either.
#pragma once

#include <cstdint>

#include "common/tiles.h"

namespace pounce::gemm {

struct TileCoord {
  int32_t expert, m_block, n_block;
};

struct TileScheduler {
  const int32_t* expert_offsets;  // [experts + 1], multiples of kBlockM
  int32_t experts;
  int32_t n_blocks;
  int32_t band_m_blocks;

  __device__ int64_t total_tiles() const { return int64_t(expert_offsets[experts] / kBlockM) * n_blocks; }

  // tile < total_tiles().
  __device__ TileCoord decode(int64_t tile) const {
    // Tiles of expert e are [first_m_block(e) * n_blocks, first_m_block(e + 1) * n_blocks).
    const int32_t expert = expert_of_row(expert_offsets, experts, (tile / n_blocks) * kBlockM);
    const int32_t first = expert_offsets[expert] / kBlockM;
    const int32_t count = expert_offsets[expert + 1] / kBlockM - first;
    const int64_t local = tile - int64_t(first) * n_blocks;
    const int32_t band = int32_t(local / (int64_t(band_m_blocks) * n_blocks));
    const int32_t band_first = band * band_m_blocks;
    const int32_t width =
        count - band_first < band_m_blocks ? count - band_first : band_m_blocks;  // last band may be narrower
    const int32_t in_band = int32_t(local - int64_t(band_first) * n_blocks);
    return {expert, first + band_first + in_band % width, in_band / width};
  }
};

}  // namespace pounce::gemm
