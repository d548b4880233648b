// The GEMM tile source of the E4M3 forward's compute CTAs: the forward's queue (moe/fused_tiles.cuh) on
// the FP8 grouped GEMM, with elementwise items that quantize each m-block's hidden rows for GEMM2:
//   G1(b): gate/up = x_rows . W13[e] in E4M3, SwiGLU, bf16 hidden rows into h_ring; waits until dispatch
//          moved m-block b's E4M3 rows and scales into the ring.
//   Q(b):  the hidden rows of m-block b quantized 1 x 128 (bit for bit the stand-alone quantizer) into
//          Fp8Rows::hidden and its K block-major scales; waits for every G1 tile of b. quantize_pieces(I)
//          items, each a share of the rows' 128-column blocks; a slice is one block of all 128 rows,
//          its two 64-column halves loaded by TMA into stage A and B.
//   G2(b): out = hidden . W2[e] in E4M3, bf16; waits for every Q item of b.
// Step j of the queue holds G1(j), Q(j-1), G2(j-2) (ElementwiseTileQueue, moe/work_queues.h): a whole
// minibatch of G1 tiles lies between a Q item and the G2 tiles waiting for it. Every wait points at an
// earlier queue entry or at dispatch, whose waits point at G2 tiles of three minibatches before (the
// ring holds at least three: FusedMoe's setup), so the queue cannot deadlock.
#pragma once

#include "common/bounded_wait.cuh"
#include "formats/quantize_device.cuh"
#include "moe/fused_kernel.h"
#include "moe/rank_tiles.cuh"

namespace pounce::moe {

class FusedFp8Tiles : public RankTiles {
 public:
  static constexpr gemm::pipeline::TileKind kKind = gemm::pipeline::TileKind::kForwardFp8;
  // The producer takes tiles from the rank's queue (decode, counter waits, the expert's search), which
  // spilled in the E4M3 kinds' 40 registers; the consumers fit the BF16 split's 224.
  static constexpr gemm::pipeline::RegisterSplit kRegisters = gemm::pipeline::kBf16Registers;
  // E4M3 slices take about half as long as BF16 ones: the claim starts twice as many slices ahead.
  static constexpr int kClaimLeadSlices = 8;

  // ops: shared [2], as in FusedTiles.
  __device__ FusedFp8Tiles(const FusedParams& p, const RankState& rs, int lr, const FusedMaps& maps,
                           gemm::pipeline::GemmOperands* ops)
      : RankTiles(p, rs, lr, 2 * p.intermediate, p.hidden, ops, kFp8TileN), hidden_load_(&maps.h_ring_load) {
    static_assert(kFp8TileN == gemm::pipeline::Fp8Stages::kTileN, "the counters count the E4M3 kind's tiles");
    if (threadIdx.x == 0) {
      const Fp8Rows& f = p.fp8_rows;
      const int32_t stride = int32_t(f.ring_rows);
      ops[0] = {&maps.x_ring_fp8,
                &maps.w13_fp8[lr],
                &maps.h_ring_store,
                gemm::Epilogue::kSwiGLU,
                nullptr,
                rs.gemm1_done,
                p.keep_gate_up ? &maps.gate_up_kept : nullptr,
                f.x_ring_scale,
                f.w13_scale[lr],
                stride,
                0};
      ops[1] = {&maps.hidden_fp8,
                &maps.w2_fp8[lr],
                &maps.out_ring_store,
                gemm::Epilogue::kStore,
                nullptr,
                rs.gemm2_done,
                nullptr,
                f.hidden_scale,
                f.w2_scale[lr],
                stride,
                0};
    }
  }

  __device__ bool next(gemm::pipeline::TileInfo& info) {
    GemmTile tile;
    if (!take_with_items(take_ticket(), pieces_, WaitTarget::kHiddenQuantized, tile)) return false;
    const int32_t m_block = tile.m_block;
    const MBlockRows m = rows_of(m_block);
    if (tile.gemm == kElementwiseItem) {
      const int32_t first = first_block(tile.n_block);
      info = {kElementwiseItem,
              {m.ring_row, first},
              {0, 0},
              m.ring_row,
              0,
              tile.n_block,
              m_block,
              first_block(tile.n_block + 1) - first,
              1,
              0,
              m.rows};
      return true;
    }
    const int32_t n = tile.gemm == 0 ? 2 * p_.intermediate : p_.hidden;
    const int32_t k_blocks = (tile.gemm == 0 ? p_.hidden : p_.intermediate) / kScaleBlock;
    info = {tile.gemm,
            {m.ring_row, 0},
            {m.expert * n + tile.n_block * kFp8TileN, 0},
            m.ring_row,
            0,
            tile.n_block,
            m_block,
            k_blocks,
            1,
            keep_row(m_block),
            m.rows};
    return true;
  }

  // The producer: slice `slice` of Q item `tile` is 128-column block tile.a.col + slice of the m-block's
  // hidden rows, its columns [0, 64) into stage A and [64, 128) into stage B (one TMA box each).
  __device__ void load_elementwise(const gemm::pipeline::TileInfo& tile, int slice, void* a, void* b,
                                   uint64_t* full) const {
    const int32_t col = (tile.a.col + slice) * kScaleBlock;
    ptx::mbarrier_arrive_expect_tx(full, 2 * kBlockM * kBlockK * sizeof(__nv_bfloat16));
    ptx::tma_load_2d(a, hidden_load_, full, col, tile.a.row);
    ptx::tma_load_2d(b, hidden_load_, full, col + kBlockK, tile.a.row);
  }

  // Every consumer thread: 8 of the slice's 128 x 16 chunks (16 bytes, 8 values). A half-warp quantizes
  // one row's block (its amax is a shuffle across the 16 lanes), a warp two rows at a time.
  // NOTES: the 8 warps of the consumers are all the SM has to hide latency with, so each thread loads its
  // 8 chunks first, then runs their 8 independent shuffle chains, then stores: done chunk by chunk, each
  // stage read (a generic load) waited behind the previous chunk's global stores, which it may alias, and
  // a slice took ~3.5 us. Padding rows are left unwritten: GEMM2's rows there feed outputs nobody reads.
  __device__ void run_elementwise(const gemm::pipeline::TileInfo& tile, int slice, const void* a, const void* b,
                                  int consumer, int thread) const {
    namespace q = formats::quantize_device;
    static_assert(kBlockK * sizeof(__nv_bfloat16) == 128, "a stage row is one 128-byte swizzle row");
    constexpr int kSteps = kBlockM / (2 * gemm::pipeline::kConsumerWarps);
    const int warp = (consumer * 128 + thread) / 32, lane = thread % 32;
    const int chunk = lane % 16;  // of the row's block: [0, 8) in stage A, [8, 16) in stage B
    const uint8_t* stage = static_cast<const uint8_t*>(chunk < 8 ? a : b);
    const int row = warp * 16 + lane / 16;  // + 2 step
    uint4 raw[kSteps];
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      // 128-byte swizzle, as TMA wrote it: 16-byte unit u of row r sits at unit u ^ (r % 8).
      const int r = row + 2 * step;
      raw[step] = *reinterpret_cast<const uint4*>(stage + r * 128 + ((chunk % 8) ^ (r % 8)) * 16);
    }
    q::QuantizedChunk quantized[kSteps];
#pragma unroll
    for (int step = 0; step < kSteps; ++step) quantized[step] = q::quantize_chunk_codes<false>(raw[step]);
    const Fp8Rows& f = p_.fp8_rows;
    const int32_t block = tile.a.col + slice;
#pragma unroll
    for (int step = 0; step < kSteps; ++step) {
      const int r = row + 2 * step;
      if (r >= tile.rows) break;  // rows past the m-block's routes: every later step's too
      const int64_t ring = int64_t(tile.c_row) + r;
      reinterpret_cast<uint2*>(f.hidden + ring * p_.intermediate + block * kScaleBlock)[chunk] = quantized[step].codes;
      if (chunk == 0) f.hidden_scale[block * f.ring_rows + ring] = q::exp2_int(quantized[step].exponent);
    }
  }

  // After both consumers ran every slice (a barrier of both: every thread's stores are done): the release
  // that lets the m-block's G2 tiles load the quantized rows.
  __device__ void finish_elementwise(const gemm::pipeline::TileInfo& tile, int consumer, int thread) const {
    if (thread == 0) ptx::red_release_gpu_add(&rs_.elementwise_done[tile.m_block], 1);
  }

 private:
  static constexpr int32_t kScaleBlock = 128;  // columns of a 1 x 128 block, and the E4M3 kind's K slice
  // First 128-column block of the hidden rows that Q piece `piece` quantizes.
  __device__ int32_t first_block(int32_t piece) const {
    return int32_t(int64_t(p_.intermediate / kScaleBlock) * piece / pieces_);
  }

  int32_t pieces_ = quantize_pieces(p_.intermediate);  // Q items per m-block

  const CUtensorMap* hidden_load_;  // bf16 hidden rows, box 64 columns x 128 rows
};

}  // namespace pounce::moe
