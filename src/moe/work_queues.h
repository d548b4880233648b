// The two work queues of one rank in the fused kernel, as pure functions of the ticket, so that the
// host tests can check the orders the deadlock-freedom argument rests on (docs/fused_moe.md).
//   communication: D(0) ... D(R-1), C(0), D(R), C(1), D(R+1), ..., C(M-1)
//                  (the opening's items D(0) ... D(m0-1), m0 = opening_blocks, are moved in pieces by
//                  every CTA of the rank before the queue starts, so its first ticket is m0)
//   GEMM tiles:    G1(0), G1(1), G2(0), G1(2), G2(1), ..., G1(n-1), G2(n-2), G2(n-1)   by minibatch,
//                  m-blocks fastest inside a minibatch. The backward's queue has an elementwise item
//                  S(b) per m-block (the SwiGLU backward between its two GEMMs), queued right before
//                  the second GEMM's tiles of its minibatch: ..., G1(j), S(j-1), G2(j-1), ...
#pragma once

#include <cstdint>

#include "common/tiles.h"

namespace pounce::moe {

struct CommItem {
  bool combine;  // C(b) pushes m-block b out; D(b) pulls it in
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

// M-blocks of the opening: the first minibatch, which every CTA of a rank pulls in pieces right after
// planning. They are the queue's first items, D(0) ... D(m0 - 1), all below the ring's size (the ring
// holds two minibatches, or every m-block: FusedMoe's setup enforces it), so none waits for a slot.
POUNCE_HOST_DEVICE inline int32_t opening_blocks(int32_t m_blocks, int32_t blocks_per_minibatch) {
  return m_blocks < blocks_per_minibatch ? m_blocks : blocks_per_minibatch;
}

// GemmTile::gemm of an elementwise item (gemm/gemm_pipeline.cuh: kElementwiseTile).
inline constexpr int32_t kElementwiseItem = 2;

struct GemmTile {
  int32_t gemm;  // 0: GEMM1 (+SwiGLU), 1: GEMM2, kElementwiseItem: S(m_block)
  int32_t m_block, n_block;
};

struct TileQueue {
  int32_t m_blocks, minibatches, blocks_per_minibatch;
  int32_t n_blocks[2];      // of GEMM1 and GEMM2
  int32_t elementwise = 0;  // 1: an S item per m-block before its GEMM2 tiles

  POUNCE_HOST_DEVICE int64_t tiles() const { return int64_t(m_blocks) * (n_blocks[0] + n_blocks[1] + elementwise); }

  // M-blocks of minibatch j.
  POUNCE_HOST_DEVICE int32_t blocks(int32_t j) const {
    const int32_t left = m_blocks - j * blocks_per_minibatch;
    return left < blocks_per_minibatch ? left : blocks_per_minibatch;
  }

  // Tile of ticket t; false past the end.
  POUNCE_HOST_DEVICE bool tile(int64_t t, GemmTile& out) const {
    const int32_t n = minibatches, bpm = blocks_per_minibatch;
    // The S items of a minibatch count as one more n-block of its GEMM2.
    const int64_t n1 = n_blocks[0], n2 = n_blocks[1] + elementwise;
    if (n == 0 || t >= tiles()) return false;
    const int64_t first = blocks(0) * n1;  // G1(0)
    if (t < first) return out = locate(0, 0, t), true;
    t -= first;
    // Pairs j = 1 .. n-1: G1(j) then G2(j-1); all full except G1(n-1).
    const int64_t full_pair = bpm * (n1 + n2);
    const int64_t pairs_tiles = n >= 2 ? (n - 2) * full_pair + blocks(n - 1) * n1 + bpm * n2 : 0;
    if (t < pairs_tiles) {
      const int64_t j_guess = 1 + t / full_pair;
      const int32_t j = int32_t(j_guess < n - 1 ? j_guess : n - 1);
      const int64_t within = t - int64_t(j - 1) * full_pair;
      const int64_t g1 = blocks(j) * n1;
      if (within < g1) return out = locate(0, j, within), true;
      return out = locate(1, j - 1, within - g1), true;
    }
    return out = locate(1, n - 1, t - pairs_tiles), true;
  }

 private:
  POUNCE_HOST_DEVICE GemmTile locate(int32_t gemm, int32_t j, int64_t local) const {
    const int32_t width = blocks(j);
    if (gemm == 1 && elementwise) {
      if (local < width) return {kElementwiseItem, j * blocks_per_minibatch + int32_t(local), 0};
      local -= width;
    }
    return {gemm, j * blocks_per_minibatch + int32_t(local % width), int32_t(local / width)};
  }
};

}  // namespace pounce::moe
