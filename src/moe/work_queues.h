// The two work queues of one rank in the fused kernel, as pure functions of the ticket, so that the
// host tests can check the orders the deadlock-freedom argument rests on (docs/fused_moe.md).
//   communication: D(0) ... D(R-1), C(0), D(R), C(1), D(R+1), ..., C(M-1)
//                  (the opening's items D(0) ... D(m0-1), m0 = opening_blocks, are moved in pieces by
//                  every CTA of the rank before the queue starts, so its first ticket is m0)
//   GEMM tiles:    G1(0), G1(1), G2(0), G1(2), G2(1), ..., G1(n-1), G2(n-2), G2(n-1)   by minibatch,
//                  m-blocks fastest inside a minibatch
//   GEMM tiles with elementwise items between the two GEMMs, step j = 0 .. n+1:  G1(j), S(j-1), G2(j-2)
//                  (the backward: its data-gradient GEMMs and SwiGLU backward; the E4M3 forward: its
//                  GEMMs and the quantization of the hidden rows). Across ranks its forward needs a
//                  ring of three minibatches: G1(j) waits for ring slots that G2(j-3) frees.
#pragma once

#include <cstdint>

#include "common/tiles.h"

namespace pounce::moe {

struct CommItem {
  bool combine;  // C(b) pushes m-block b out; D(b) pulls it in
  int32_t m_block;
  bool x_rows = false;  // X(b), a backward without kept x rows: pulls the kept forward's x rows of m-block b
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

// Item i (< 3M; in place < 2M) of the backward's queue where it pulls x rows, every m-block with its own ring slot
// (FusedLayer::fused_backward sets ring_blocks to the capacity's m-blocks; with fewer, D(b >= R) would
// wait for a C item queued behind it) and the weight gradients need each row's x beside its dy: D(0) ... D(M-1), X(0)
// ... X(M-1), C(0) ... C(M-1). Neither D nor X items wait; the pushes wait for the GEMMs, so the x rows move while the
// first GEMMs run.
POUNCE_HOST_DEVICE inline CommItem backward_comm_item(int64_t i, int32_t m_blocks) {
  if (i < m_blocks) return {false, int32_t(i)};
  if (i < 2 * int64_t(m_blocks)) return {false, int32_t(i - m_blocks), true};
  return {true, int32_t(i - 2 * int64_t(m_blocks))};
}

// M-blocks of the opening: the first minibatch, which every CTA of a rank pulls in pieces right after
// planning. They are the queue's first items, D(0) ... D(m0 - 1), all below the ring's size (the ring
// holds two minibatches, or every m-block: FusedMoe's setup enforces it), so none waits for a slot.
POUNCE_HOST_DEVICE inline int32_t opening_blocks(int32_t m_blocks, int32_t blocks_per_minibatch) {
  return m_blocks < blocks_per_minibatch ? m_blocks : blocks_per_minibatch;
}

struct GemmTile {
  int32_t gemm;  // 0: GEMM1 (+SwiGLU), 1: GEMM2; ElementwiseTileQueue's also kElementwiseItem (n_block: its piece)
  int32_t m_block, n_block;
};

struct TileQueue {
  int32_t m_blocks, minibatches, blocks_per_minibatch;
  int32_t n_blocks[2];  // of GEMM1 and GEMM2

  POUNCE_HOST_DEVICE int64_t tiles() const { return int64_t(m_blocks) * (n_blocks[0] + n_blocks[1]); }

  // M-blocks of minibatch j.
  POUNCE_HOST_DEVICE int32_t blocks(int32_t j) const {
    const int32_t left = m_blocks - j * blocks_per_minibatch;
    return left < blocks_per_minibatch ? left : blocks_per_minibatch;
  }

  // Tile of ticket t; false past the end.
  POUNCE_HOST_DEVICE bool tile(int64_t t, GemmTile& out) const {
    const int32_t n = minibatches, bpm = blocks_per_minibatch;
    const int64_t n1 = n_blocks[0], n2 = n_blocks[1];
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
    return {gemm, j * blocks_per_minibatch + int32_t(local % width), int32_t(local / width)};
  }
};

// GemmTile::gemm of an elementwise item (gemm/gemm_pipeline.cuh: kElementwiseTile).
inline constexpr int32_t kElementwiseItem = 2;

// How an elementwise item's rows go through the stages (moe/fused_backward_tiles.cuh): its `rows` rows
// of `groups` 16-byte groups are cut into segments of at most `segment_groups` groups that never cross
// a row, numbered row-major; slice s holds segments [s * per_slice, (s + 1) * per_slice), which lie back
// to back in memory (so do the rows). Positions count groups from the item's first row.
struct ElementwiseSlices {
  int64_t groups;  // of a row
  int32_t rows, segment_groups, per_slice;

  POUNCE_HOST_DEVICE int64_t segments_per_row() const { return (groups + segment_groups - 1) / segment_groups; }
  POUNCE_HOST_DEVICE int64_t segments() const { return rows * segments_per_row(); }
  POUNCE_HOST_DEVICE int32_t slices() const { return int32_t((segments() + per_slice - 1) / per_slice); }
  POUNCE_HOST_DEVICE int64_t segment_start(int64_t q) const {
    return q / segments_per_row() * groups + q % segments_per_row() * segment_groups;
  }
  POUNCE_HOST_DEVICE int64_t segment_end(int64_t q) const {
    const int64_t end_in_row = (q % segments_per_row() + 1) * segment_groups;
    return q / segments_per_row() * groups + (end_in_row < groups ? end_in_row : groups);
  }
  POUNCE_HOST_DEVICE int64_t slice_start(int32_t s) const { return segment_start(int64_t(s) * per_slice); }
  POUNCE_HOST_DEVICE int64_t slice_end(int32_t s) const {
    const int64_t next = int64_t(s + 1) * per_slice;
    return segment_end((next < segments() ? next : segments()) - 1);
  }
};

// The queue of the fused kernels with elementwise items between their GEMMs (the backward's, the E4M3
// forward's). Step j holds D1(j) (the first GEMM's tiles of minibatch j), S(j-1) (the elementwise items
// of minibatch j-1, `pieces` per m-block) and D2(j-2) (the second GEMM's tiles of minibatch j-2),
// m-blocks fastest in each. S(b) waits for D1(b) and D2(b) for S(b): a whole minibatch of D1 tiles lies
// between an S item and the D2 tiles waiting for it.
struct ElementwiseTileQueue {
  int32_t m_blocks, minibatches, blocks_per_minibatch;
  int32_t n_blocks[2];  // of D1 and D2
  int32_t pieces;       // S items per m-block

  POUNCE_HOST_DEVICE int64_t tiles() const { return int64_t(m_blocks) * (n_blocks[0] + pieces + n_blocks[1]); }

  // M-blocks of minibatch j; 0 outside [0, minibatches).
  POUNCE_HOST_DEVICE int32_t blocks(int32_t j) const {
    if (j < 0 || j >= minibatches) return 0;
    const int32_t left = m_blocks - j * blocks_per_minibatch;
    return left < blocks_per_minibatch ? left : blocks_per_minibatch;
  }

  POUNCE_HOST_DEVICE bool tile(int64_t t, GemmTile& out) const {
    const int32_t n = minibatches;
    if (n == 0 || t < 0 || t >= tiles()) return false;
    // Steps 0 and 1, then steps 2 .. n-2 (every section whole: one size), then steps max(2, n-1) .. n+1.
    int64_t at = 0;
    for (int32_t j = 0; j < 2; ++j) {
      const int64_t size = step_size(j);
      if (t < at + size) return out = locate(j, t - at), true;
      at += size;
    }
    const int64_t whole = int64_t(blocks_per_minibatch) * (n_blocks[0] + pieces + n_blocks[1]);
    const int32_t middle = n > 3 ? n - 3 : 0;
    if (t < at + middle * whole) return out = locate(2 + int32_t((t - at) / whole), (t - at) % whole), true;
    at += middle * whole;
    for (int32_t j = n - 1 > 2 ? n - 1 : 2; j <= n + 1; ++j) {
      const int64_t size = step_size(j);
      if (t < at + size) return out = locate(j, t - at), true;
      at += size;
    }
    return false;
  }

 private:
  POUNCE_HOST_DEVICE int64_t step_size(int32_t j) const {
    return int64_t(blocks(j)) * n_blocks[0] + int64_t(blocks(j - 1)) * pieces + int64_t(blocks(j - 2)) * n_blocks[1];
  }

  POUNCE_HOST_DEVICE GemmTile locate(int32_t j, int64_t local) const {
    const int64_t d1 = int64_t(blocks(j)) * n_blocks[0], s = int64_t(blocks(j - 1)) * pieces;
    int32_t gemm = 0, minibatch = j;
    if (local >= d1 + s) {
      gemm = 1, minibatch = j - 2, local -= d1 + s;
    } else if (local >= d1) {
      gemm = kElementwiseItem, minibatch = j - 1, local -= d1;
    }
    const int32_t width = blocks(minibatch);
    return {gemm, minibatch * blocks_per_minibatch + int32_t(local % width), int32_t(local / width)};
  }
};

}  // namespace pounce::moe
