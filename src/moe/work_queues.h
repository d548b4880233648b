// The communication queue of one rank in the fused kernel as a pure function of the ticket, so that
// host tests can check the order the deadlock-freedom argument rests on (docs/fused_moe.md):
//   D(0) ... D(R-1), C(0), D(R), C(1), D(R+1), ..., C(M-1)
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define POUNCE_HOST_DEVICE __host__ __device__
#else
#define POUNCE_HOST_DEVICE
#endif

namespace pounce::moe {

struct CommItem {
  bool combine;     // C(b) pushes m-block b out; D(b) pulls it in
  int32_t m_block;
};

// Item i (< 2M) of a queue with M m-blocks and R ring blocks.
POUNCE_HOST_DEVICE inline CommItem comm_item(int64_t i, int32_t m_blocks, int32_t ring_blocks) {
  const int32_t head = ring_blocks < m_blocks ? ring_blocks : m_blocks;
  if (i < head) return {false, int32_t(i)};
  const int64_t u = i - head;
  const int64_t pairs = m_blocks - head;  // C(b), D(b + R) for b < M - R
  if (u < 2 * pairs) return {u % 2 == 0, int32_t(u % 2 == 0 ? u / 2 : u / 2 + ring_blocks)};
  return {true, int32_t(pairs + (u - 2 * pairs))};
}

}  // namespace pounce::moe
