// The GEMM tile source of the fused backward's compute CTAs: like the forward's (moe/fused_tiles.cuh),
// with the backward's two data-gradient GEMMs and elementwise items between them:
//   D1(b): da = dy_rows . W2[e] (W2 read N-major); waits until dispatch pulled m-block b's dy rows.
//   S(b):  the SwiGLU backward of b's rows (moe/backward/swiglu_backward.cuh) from da and the kept
//          gate/up rows: dgu, w.a and each route's router-weight gradient, written to its source rank;
//          waits for every D1 tile of b. kSwigluPieces items of 32 rows, fed through the stages: each
//          slice holds kSliceSegments consecutive row segments (row-major over the item's rows), their
//          da values in stage A and their gate/up values in stage B, two bulk copies since the rows lie
//          back to back in both buffers; each of the 8 consumer warps takes one segment of a slice.
//   D2(b): dx_rows = dgu . W13[e] (W13 read N-major); waits for every piece of S(b).
//   W(e):  with BackwardRows::weight_grads, expert e's weight gradients, k-grouped over its rows:
//          dW2[e] = dy_rows^T . wa, then dW13[e] = dgu^T . x_rows; a CTA's first W tile waits for every
//          S item (they wrote wa and dgu, and zeroed the padding rows of dy and x that the last K slice
//          sums) and, where the x rows were not kept, every X item (the x rows): one wait each, where each tile waiting
//          for its expert's m-blocks, one counter after the other, cost the fused backward up to 10 % on
//          one H200.
// Step j of the queue holds D1(j), S(j-1), D2(j-2) (moe/work_queues.h); the W tiles follow the last step:
// every expert's dW2 tiles, then every expert's dW13 tiles. Every wait points at an earlier queue entry or
// at communication items that wait for nothing (D and X: the backward's ring holds every m-block), so the
// queue cannot deadlock.
#pragma once

#include "common/bounded_wait.cuh"
#include "moe/backward/swiglu_backward.cuh"
#include "moe/fused_kernel.h"
#include "moe/rank_tiles.cuh"

namespace pounce::moe {

static_assert(kElementwiseItem == gemm::pipeline::kElementwiseTile, "queue and pipeline name S items alike");

// NOTES: loaded by the consumer warps from global memory, a row at a time, these items ran at ~7 GB/s per
// warpgroup (bound by the loads in flight); a slice's bulk copies put 48 KB in flight per stage.
inline constexpr int kSwigluRows = kBlockM / kSwigluPieces;  // of an S item
inline constexpr int kSliceSegments = gemm::pipeline::kConsumerWarps;
static_assert(kSliceSegments * backward::kSegmentGroups * 16 == kBlockM * kBlockK * sizeof(__nv_bfloat16),
              "a slice's da values fill stage A, and its gate/up values (twice as many) stage B");

class FusedBackwardTiles : public RankTiles {
 public:
  static constexpr gemm::pipeline::TileKind kKind = gemm::pipeline::TileKind::kBackward;
  static constexpr int32_t kWeightDown = gemm::pipeline::kWeightGradTile, kWeightGateUp = kWeightDown + 1;
  static constexpr int kOperands = 4;  // D1, D2, dW2, dW13: operands() skips the S items' number

  // ops: shared [kOperands].
  __device__ FusedBackwardTiles(const FusedParams& p, const RankState& rs, int lr, const FusedMaps& maps,
                                gemm::pipeline::GemmOperands* ops)
      : RankTiles(p, rs, lr, p.intermediate, p.hidden, ops) {
    slices_ = {p.intermediate / 8, kSwigluRows, backward::kSegmentGroups, kSliceSegments};
    groups_ = int32_t(slices_.groups);
    segments_per_row_ = int32_t(slices_.segments_per_row());
    segments_ = int32_t(slices_.segments());
    data_tiles_ = p.bwd.weight_grads ? elementwise_queue(kSwigluPieces).tiles() : INT64_MAX;
    // A weight gradient [M, N] per expert in tiles of kBlockM x kBlockN: dW2 is H x I, dW13 2I x H.
    down_n_blocks_ = int32_t(n_blocks(p.intermediate));
    gate_up_n_blocks_ = int32_t(n_blocks(p.hidden));
    down_tiles_ = int32_t((p.hidden + kBlockM - 1) / kBlockM) * down_n_blocks_;
    expert_tiles_ = down_tiles_ + int32_t((2 * p.intermediate + kBlockM - 1) / kBlockM) * gate_up_n_blocks_;
    if (threadIdx.x == 0) {
      ops[0] = {&maps.x_ring,  &maps.w2[lr], &maps.h_ring_store, gemm::Epilogue::kStore, nullptr,
                rs.gemm1_done, nullptr};
      ops[1] = {&maps.h_ring_load, &maps.w13[lr], &maps.out_ring_store, gemm::Epilogue::kStore, nullptr,
                rs.gemm2_done,     nullptr};
      const gemm::Epilogue out = p.bwd.weight_grad_epilogue;
      ops[kWeightDown - 1] = {&maps.wgrad_dy, &maps.wgrad_wa, &maps.wgrad_dw2[lr], out, nullptr, nullptr, nullptr};
      ops[kWeightGateUp - 1] = {&maps.wgrad_dgu, &maps.wgrad_x, &maps.wgrad_dw13[lr], out, nullptr, nullptr, nullptr};
    }
  }

  __device__ const gemm::pipeline::GemmOperands& operands(int gemm) const {
    static_assert(kElementwiseItem + 1 == kWeightDown, "the S items' number lies between the GEMMs' and the W tiles'");
    return ops_[gemm > kElementwiseItem ? gemm - 1 : gemm];
  }

  __device__ bool next(gemm::pipeline::TileInfo& info) {
    const int64_t ticket = take_ticket();
    if (ticket >= data_tiles_) return weight_grad_tile(ticket - data_tiles_, info);
    GemmTile tile;
    if (!take_with_items(ticket, kSwigluPieces, WaitTarget::kSwigluDone, tile)) return false;
    const int32_t m_block = tile.m_block;
    const MBlockRows m = rows_of(m_block);
    if (tile.gemm == kElementwiseItem) {
      info = {kElementwiseItem, {m.ring_row, 0},  {0, 0}, m.ring_row,        0,     tile.n_block,
              m_block,          slices_.slices(), 1,      keep_row(m_block), m.rows};
      return true;
    }
    // B is N-major [experts * K, N]: the expert's first K row, the n-block's column.
    const int32_t k = tile.gemm == 0 ? p_.hidden : 2 * p_.intermediate;
    info = {tile.gemm,
            {m.ring_row, 0},
            {m.expert * k, tile.n_block * kBlockN},
            m.ring_row,
            0,
            tile.n_block,
            m_block,
            k / kBlockK,
            1,
            0,
            m.rows};
    return true;
  }

  // W tile w (the weight gradients' queue, after the data path's): every expert's dW2 tiles, then every
  // expert's dW13 tiles, as the two stand-alone k-grouped GEMMs order them (expert-major, n-blocks
  // fastest). K runs over the expert's routed rows (the K slices past them hold only padding), from its
  // first ring row: they lie together since the backward's ring holds every m-block (ring_blocks = M).
  // An expert without any stores zeros (kAddF32: adds them).
  __device__ bool weight_grad_tile(int64_t w, gemm::pipeline::TileInfo& info) {
    const int64_t down_all = int64_t(down_tiles_) * p_.local_experts;
    const bool down = w < down_all;
    const int32_t per_expert = down ? down_tiles_ : expert_tiles_ - down_tiles_;
    const int64_t v = down ? w : w - down_all;
    const int64_t e64 = v / per_expert;
    if (e64 >= p_.local_experts) return false;
    const int32_t e = int32_t(e64);
    const int32_t in_expert = int32_t(v - e64 * per_expert);
    const int32_t columns = down ? down_n_blocks_ : gate_up_n_blocks_;
    const int32_t m_block = in_expert / columns, n_block = in_expert % columns;
    if (!inputs_done_) {  // unless kept in place, the x rows come by X items
      const WaitSite site{p_.error, DeviceRole::kGemmProducer, p_.wait_timeout_ns, rs_.rank};
      const uint32_t items = uint32_t(sizes_.m_blocks) * kSwigluPieces * gemm::kConsumerWarpgroups;
      if (!counter_wait_bounded(&rs_.control[kItemsDone], items, site, WaitTarget::kWgradInputs, 0)) return false;
      if (p_.bwd.x_rows != nullptr &&
          !counter_wait_bounded(&rs_.control[kXRowsDone], uint32_t(sizes_.m_blocks), site, WaitTarget::kWgradInputs, 1))
        return false;
      inputs_done_ = true;
    }
    // NOTES: the rows were written by other CTAs (bulk copies, TMA stores, the S items' stores), acquired
    // above through the generic proxy; TMA reads them through the async proxy.
    ptx::fence_proxy_async_global();
    const int32_t routes = rs_.expert_routes[e];
    const int32_t first_row = int32_t(ring_row(p_, lr_, rs_.expert_offsets[e] / kBlockM, 0));
    info = {down ? kWeightDown : kWeightGateUp,
            {first_row, m_block * kBlockM},
            {first_row, n_block * kBlockN},
            m_block * kBlockM,
            e,
            n_block,
            m_block,
            (routes + kBlockK - 1) / kBlockK,
            1,
            0,
            kBlockM};
    return true;
  }

  // The producer: slice `slice` of S item `tile`, da into stage A and the kept gate/up values into B.
  __device__ void load_elementwise(const gemm::pipeline::TileInfo& tile, int slice, void* a, void* b,
                                   uint64_t* full) const {
    const int64_t first_row = int64_t(tile.n_block) * kSwigluRows, first = slices_.slice_start(slice);
    const uint32_t bytes = uint32_t(slices_.slice_end(slice) - first) * 16;
    const int64_t groups = slices_.groups;
    const uint4* da = reinterpret_cast<const uint4*>(p_.h_ring) + (tile.c_row + first_row) * groups + first;
    const uint4* gate_up =
        reinterpret_cast<const uint4*>(p_.bwd.gate_up_kept) + ((tile.keep_row + first_row) * groups + first) * 2;
    // Both are read once, here: evict-first keeps them from pushing the GEMM tiles' operands out of L2.
    const uint64_t read_once = ptx::l2_evict_first_policy();
    ptx::mbarrier_arrive_expect_tx(full, 3 * bytes);
    ptx::bulk_load(a, da, bytes, full, read_once);
    ptx::bulk_load(b, gate_up, 2 * bytes, full, read_once);
  }

  // A consumer warp: its segment of the slice. Padding rows get zero dgu and w.a, and zero dy and x rows
  // too: the weight gradients sum the padding rows of their last K slices, which dispatch leaves stale.
  __device__ void run_elementwise(const gemm::pipeline::TileInfo& tile, int slice, const void* a, const void* b,
                                  int consumer, int thread) const {
    const int lane = thread % 32;
    const int32_t segment = slice * kSliceSegments + consumer * 4 + thread / 32;  // of the item
    if (segment >= segments_) return;
    const int32_t item_row = segment / segments_per_row_, part = segment - item_row * segments_per_row_;
    const int32_t r = tile.n_block * kSwigluRows + item_row;  // row of the m-block
    const int64_t row = int64_t(tile.m_block) * kBlockM + r, ring = int64_t(tile.c_row) + r;
    const BackwardRows& bw = p_.bwd;
    // The row's schedule entries and weight (copied beside the dy row by dispatch), all four in flight
    // together: beside the GEMMs' traffic a load takes ~1 us, and loaded one after the other where each
    // was needed they added ~2 us to a 32-row item on Qwen3-30B (13.6 against 11.3 us).
    const RowRoute route = route_of(row);
    const float w = ptx::ld_relaxed_gpu(bw.row_weight + ring);
    const int32_t first = part * backward::kSegmentGroups;  // group of the row
    const int groups = min(backward::kSegmentGroups, groups_ - first);
    uint4* dgu = reinterpret_cast<uint4*>(bw.dgu) + (ring * groups_ + first) * 2;
    uint4* wa = reinterpret_cast<uint4*>(bw.wa) + ring * groups_ + first;
    if (route.token < 0) {
      backward::swiglu_backward_padding_row(groups, dgu, wa, lane);
      if (first == 0) {
        const int64_t h_vecs = p_.hidden / 8;
        uint4* dy = reinterpret_cast<uint4*>(p_.x_ring) + ring * h_vecs;
        for (int64_t v = lane; v < h_vecs; v += 32) dy[v] = make_uint4(0, 0, 0, 0);
        if (bw.wgrad_x_rows != nullptr) {
          uint4* x = reinterpret_cast<uint4*>(bw.wgrad_x_rows) + ring * h_vecs;
          for (int64_t v = lane; v < h_vecs; v += 32) x[v] = make_uint4(0, 0, 0, 0);
        }
      }
      return;
    }
    // Where the segment lies in the stages: groups from the slice's first, the rows back to back.
    const int32_t slice_first = slice * kSliceSegments, slice_row = slice_first / segments_per_row_;
    const int32_t at = (item_row - slice_row) * groups_ + first -
                       (slice_first - slice_row * segments_per_row_) * backward::kSegmentGroups;
    const float dot = backward::swiglu_backward_segment(
        reinterpret_cast<const uint4*>(b) + 2 * at, reinterpret_cast<const uint4*>(a) + at, w, groups, dgu, wa, lane);
    if (lane != 0) return;
    if (segments_per_row_ == 1)  // the route's gradient is this sum, added to 0 as swiglu_backward_row adds it
      bw.d_topk_weights[route.source][int64_t(route.token) * p_.topk + route.k] = 0.0f + dot;
    else
      bw.segment_dots[ring * segments_per_row_ + part] = dot;
  }

  // Each route's router-weight gradient of rows of several segments: their sums in order (as
  // swiglu_backward_row adds them); then the release that lets D2 tiles (and the weight gradients) read
  // the item's rows.
  __device__ void finish_elementwise(const gemm::pipeline::TileInfo& tile, int consumer, int thread) const {
    const BackwardRows& bw = p_.bwd;
    if (consumer == 0 && thread < kSwigluRows && segments_per_row_ > 1) {
      const int32_t r = tile.n_block * kSwigluRows + thread;
      const int64_t row = int64_t(tile.m_block) * kBlockM + r, ring = int64_t(tile.c_row) + r;
      // Every load in flight at once, as in run_elementwise (a padding row's sums are never used).
      const RowRoute route = route_of(row);
      float dot = 0.0f;
      for (int32_t s = 0; s < segments_per_row_; ++s)
        dot += ptx::ld_relaxed_gpu(bw.segment_dots + ring * segments_per_row_ + s);
      if (route.token >= 0) bw.d_topk_weights[route.source][int64_t(route.token) * p_.topk + route.k] = dot;
    }
    // Every warp's stores before the release. Across GPUs the router-weight gradients went to the source
    // ranks' memory: a system-scope fence, so that the pushes of the dx rows behind this release (the
    // source acquires their arrivals at system scope) order them too.
    ptx::named_barrier_sync(gemm::pipeline::kEpilogueBarrierBase + consumer, 128);
    if (thread == 0) {
      if (p_.peers_on_this_gpu)
        __threadfence();
      else
        ptx::fence_acq_rel_sys();
      ptx::red_release_gpu_add(&rs_.elementwise_done[tile.m_block], 1);
      if (p_.bwd.weight_grads) ptx::red_release_gpu_add(&rs_.control[kItemsDone], 1);
    }
  }

 private:
  // A schedule row's route (token -1: padding), its three entries in flight together: strong loads, which
  // ptxas leaves where they are written, where it sinks plain ones into their uses one after the other.
  struct RowRoute {
    int32_t token, source, k;
  };
  __device__ RowRoute route_of(int64_t row) const {
    return {ptx::ld_relaxed_gpu(rs_.row_token + row), ptx::ld_relaxed_gpu(rs_.row_source_rank + row),
            ptx::ld_relaxed_gpu(rs_.row_k + row)};
  }

  ElementwiseSlices slices_;  // of an S item: rows of da in 16-byte groups, their segments and slices
  int32_t groups_, segments_per_row_, segments_;  // slices_' in 32 bits, for the consumers' index math
  int64_t data_tiles_;                            // tickets of the data path; the W tiles follow
  bool inputs_done_ = false;                      // the fetcher saw every S item (and X item) done
  int32_t down_n_blocks_, gate_up_n_blocks_, down_tiles_, expert_tiles_;  // W tiles per expert
};

}  // namespace pounce::moe
