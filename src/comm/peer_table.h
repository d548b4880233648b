// What the kernels see of the other ranks: one device pointer per rank to its symmetric buffer (same
// layout on every rank). Filled once at setup by a transport backend (NCCL windows across GPUs, or
// virtual ranks carved out of one allocation on one GPU); kernels never see a transport type.
#pragma once

#include <cuda_runtime.h>  // __host__ __device__

#include <cstddef>
#include <cstdint>

#include "pounce/config.h"

namespace pounce::comm {

struct PeerTable {
  static constexpr int kMaxRanks = pounce::kMaxRanks;
  int32_t ranks = 0;
  int32_t rank = 0;  // this rank
  size_t bytes = 0;  // of each rank's symmetric buffer
  uint8_t* base[kMaxRanks] = {};

  // Address of `offset` in rank r's symmetric buffer.
  __host__ __device__ uint8_t* at(int r, size_t offset) const { return base[r] + offset; }
};

}  // namespace pounce::comm
