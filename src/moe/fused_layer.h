// The fused MoE layer behind pounce::FusedMoe (include/pounce/fused_moe.h): buffers, setup, and the
// launch of one persistent kernel per forward that runs the routing planner, pull-based dispatch into a
// fixed ring of token rows, GEMM1 + SwiGLU and GEMM2 on the compute SMs gated by per-m-block counters,
// push-based combine into each source rank's [token, k] slots and the weighted sum, for an
// expert-parallel group of P ranks (docs/design.md §3, §4; docs/fused_moe.md).
//
// Two transports, one kernel:
//   virtual ranks: all P ranks on ONE GPU, one launch whose CTAs are partitioned by rank, each rank with
//                  its own schedule, ring, counters and weights, talking through the same protocol and
//                  peer pointers a multi-GPU group uses. P = 1 is the plain single-GPU layer.
//   NCCL:          one rank per GPU (one process per GPU, or one process driving several), peers
//                  reached through an NCCL 2.28 symmetric window's LSA (NVLink load/store) pointers.
//
// Weights: each rank's own E/P experts, w13 [E/P, 2I, H] (gate and up interleaved in groups of 8 rows,
// reference::w13_row) and w2 [E/P, H, I], bf16; the kernel indexes them by local expert.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "comm/nccl_window.h"
#include "common/device_buffer.h"
#include "common/device_error.h"
#include "moe/backward/backward_chain.h"
#include "moe/fused_kernel.h"
#include "moe/shared_rows.h"
#include "planner/schedule.h"
#include "pounce/fused_moe.h"

namespace pounce::moe {

class FusedLayer {
 public:
  // Virtual ranks: all config.ranks ranks on the current GPU. Throws pounce::Error on an invalid config
  // or options, naming the first problem.
  FusedLayer(const EpConfig& config, const FusedMoeOptions& options);
  // This GPU's rank of `comm` (config.ranks ranks, one per GPU). Collective: every rank constructs its
  // layer with the same config and options (checked: a mismatch throws, naming the field and rank).
  FusedLayer(const EpConfig& config, ncclComm_t comm, const FusedMoeOptions& options);
  ~FusedLayer();

  void set_weights(std::span<const ExpertWeights> ranks);
  void forward(std::span<const RankIO> ranks, cudaStream_t stream, bool keep_for_backward);
  void backward(std::span<const RankIO> forward_inputs, std::span<const RankGrads> grads, WeightGradOutput mode,
                cudaStream_t stream);
  void refresh_fp8_weights(cudaStream_t stream);
  void check_device_errors();

  const EpConfig& config() const { return config_; }
  int ctas_per_rank() const { return params_.ctas_per_rank; }
  int comm_ctas() const { return params_.comm_ctas; }
  int engine_rows() const { return params_.engine_rows; }
  int64_t minibatch_rows() const { return int64_t(params_.blocks_per_minibatch) * kBlockM; }
  int64_t backward_minibatch_rows() const;
  int64_t ring_blocks() const { return params_.ring_blocks; }
  // One rank whose ring holds every m-block: GEMM2's rows are summed where they are, no combine step.
  bool in_place() const { return params_.in_place != 0; }
  int64_t max_m_blocks() const { return capacity_.max_m_blocks; }
  int ranks_on_this_gpu() const { return params_.launch_ranks; }
  int64_t device_bytes() const;
  // The part of device_bytes() shared with the other layers of the same shape on this GPU (the forward's
  // hidden and output rings and the backward's route rows: moe/shared_rows.h), and which set that is.
  int64_t shared_device_bytes() const { return shared_rows_->bytes(); }
  const void* shared_buffers_id() const { return shared_rows_.get(); }
  bool last_backward_replayed() const { return last_backward_replayed_; }
  void start_timeline(int64_t max_events);
  std::string stop_timeline();

  // Fault injection for tests (moe/layer_testing.h): this rank's CTAs move no rows.
  void stall_rank(int rank) { params_.stall_rank = rank; }

 private:
  void setup(const EpConfig& config, const FusedMoeOptions& options, int launch_ranks, int first_rank);
  void check_io(const RankIO& io, int rank) const;
  static void check_same_config_on_every_rank(const EpConfig& config, const FusedMoeOptions& options, ncclComm_t comm);
  void reset_counters();
  bool kept_forward_matches(std::span<const RankIO> inputs) const;
  uint64_t fingerprint(std::span<const RankIO> inputs) const;
  KeptForward kept_rows(int launch_rank) const;
  void fused_backward(std::span<const RankIO> forward_inputs, std::span<const RankGrads> grads,
                      std::span<const BackwardSource> sources, std::span<const ExpertGradients> experts,
                      cudaStream_t stream);
  TimelineSink backward_timeline();

  EpConfig config_;
  planner::Capacity capacity_;
  FusedParams params_{};
  FusedMaps maps_{};
  bool has_weights_ = false;
  DeviceErrorSlot errors_;
  // This launch's ranks' private buffers, a slice per rank.
  DeviceBuffer<int32_t> chunk_counts_, expert_routes_, expert_offsets_, row_source_rank_, row_token_, row_k_,
      minibatch_starts_;
  DeviceBuffer<planner::DeviceScheduleSizes> sizes_;
  DeviceBuffer<const int32_t*> topk_tables_;
  DeviceBuffer<int32_t> rank_routes_;   // [launch ranks, P], a bounded capacity only: every rank's routes
  DeviceBuffer<int32_t> route_row_;     // one rank: [T_max, k] the row of every route (in place: its ring row)
  DeviceBuffer<uint32_t> counters_;     // dispatched, gemm1_done, gemm2_done, combined, control
  DeviceBuffer<uint32_t> epoch_;        // the forward number, bumped on the device by every forward
  DeviceBuffer<uint64_t> kept_record_;  // FusedParams::kept_record
  uint32_t forwards_ = 0;               // forwards enqueued since the counters were last cleared
  DeviceBuffer<__nv_bfloat16> x_ring_;  // in place, kept (or E4M3): otherwise the ring is all shared_rows_'s
  bool x_rows_kept_ = false;            // in place, bf16, FusedMoeOptions::keep_x_rows: x_ring_ holds them
  // Symmetric buffers: virtual ranks keep them here; the NCCL transport in its window.
  DeviceBuffer<uint32_t> peer_words_;  // per rank: arrivals [T_max], start flags [P]
  DeviceBuffer<int32_t> token_counts_;
  DeviceBuffer<__nv_bfloat16> slots_;
  int64_t slot_elems_ = 0;                          // per rank: combine slots [T_max, k, H]; 0 in place (setup)
  std::unique_ptr<BackwardChain> backward_;         // made on the first backward
  std::array<ExpertWeights, kMaxRanks> weights_{};  // [launch rank], for the backward
  // A training forward's gate/up rows before SwiGLU, [launch ranks * capacity rows, 2I] (made by the
  // first one), and which forward they belong to: the backward uses them only for the latest forward,
  // on the same inputs and weights; otherwise it replays.
  DeviceBuffer<__nv_bfloat16> gate_up_kept_;
  struct KeptFrom {
    uint32_t forward = 0;  // forwards_ at that forward; 0: nothing kept
    std::array<RankIO, kMaxRanks> io{};
    std::array<ExpertWeights, kMaxRanks> weights{};
  } kept_from_;
  bool last_backward_replayed_ = false;
  bool backward_replays_ = true;        // FusedMoeOptions::backward_replays
  bool fused_backward_enabled_ = true;  // FusedMoeOptions::fused_backward
  // FusedMoeOptions::fp8_data_gradients: each launch rank's E4M3 weight copies (made by the first
  // refresh), and whether they were refreshed since the last set_weights.
  bool fp8_data_gradients_ = false;
  bool fp8_weight_gradients_ = false;  // FusedMoeOptions::fp8_weight_gradients
  std::vector<std::unique_ptr<Fp8TransposedWeights>> fp8_weights_;
  bool fp8_fresh_ = false;
  // FusedMoeOptions::fp8_forward: the E4M3 rows of the forward (FusedParams::fp8_rows, PeerView::x_fp8)
  // and each launch rank's E4M3 weight copies, made by setup().
  struct Fp8ForwardState {
    DeviceBuffer<uint8_t> tokens;  // [ranks, T_max, H] (virtual ranks; across GPUs the window holds them)
    DeviceBuffer<uint8_t> x_ring, hidden;
    DeviceBuffer<float> token_scales, x_ring_scale, hidden_scale;
    std::vector<DeviceBuffer<uint8_t>> w13, w2;  // [launch rank]
    std::vector<DeviceBuffer<float>> w13_scale, w2_scale;
    int64_t bytes() const;
  };
  std::unique_ptr<Fp8ForwardState> fp8_forward_;
  void setup_fp8_forward(int64_t ring_rows);
  // The fused backward's own counters, number and peer words (virtual ranks), made by the first fused
  // backward. Its rows (a ring holding every m-block of every launch rank, kept for the weight
  // gradients) are shared_rows_'s.
  struct FusedBackwardState {
    DeviceBuffer<uint32_t> counters, epoch, peer_words;
    int64_t bytes() const;
  };
  std::unique_ptr<FusedBackwardState> fused_backward_;
  // The forward's hidden and output rings and the backward's route rows, shared with every layer of
  // this shape on this GPU.
  std::shared_ptr<SharedRows> shared_rows_;
  std::unique_ptr<Timeline> timeline_;  // between start_timeline and stop_timeline
  std::unique_ptr<comm::NcclWindow> window_;
  int64_t window_bytes_ = 0;
  __nv_bfloat16* window_x_[2][kMaxRanks] = {};  // [forward parity][rank]
  int32_t* window_ids_[2][kMaxRanks] = {};
  int32_t* window_counts_[2][kMaxRanks] = {};
  // The fused backward across GPUs: what peers read (router weights [T_max, k]) and write (their
  // gradients [T_max, k]; the backward's arrivals [T_max] and start flags [P]). Its dy goes into the x
  // buffer of the parity its kept forward did not use (FusedLayer::fused_backward says why that is free).
  float* window_weights_[kMaxRanks] = {};
  float* window_d_topk_[kMaxRanks] = {};
  uint32_t* window_backward_words_[kMaxRanks] = {};
  int device_ = -1;      // the GPU the layer's buffers live on
  bool failed_ = false;  // NCCL, P > 1: a device error ended this layer
  std::string failed_reason_;
};

}  // namespace pounce::moe
