#include "moe/fused_layer.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "common/device_pointer.h"
#include "common/gpu.h"
#include "formats/quantize_kernel.h"
#include "gemm/grouped_gemm.h"
#include "gemm/tensor_map.h"
#include "moe/backward/backward_kernels.h"
#include "planner/device_planner.h"
#include "planner/wave_model.h"

namespace pounce::moe {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Minibatches the default ring holds at least, when no ring_bytes budget is set: smaller rings make
// dispatch wait for combines (the benchmark's ring sweep, docs/results.md).
constexpr int64_t kDefaultRingMinibatches = 6;

// The fused backward's minibatch, at least (FusedLayer::backward_minibatch_rows): the stand-alone
// engine's band.
constexpr int64_t kBackwardMinibatchBlocks = 16;

// CTAs of each rank: the option, else the GPU's multiprocessors shared by the ranks launched on it.
int resolved_ctas_per_rank(const FusedMoeOptions& options, int launch_ranks) {
  return options.ctas_per_rank > 0 ? options.ctas_per_rank : gpu_info().multiprocessors / launch_ranks;
}

// Communication CTAs of a rank: it moves 4·H bytes per routed row (dispatch and combine) for 6·H·I
// FLOPs of GEMM, so the CTAs that keep rows ahead of the GEMMs go as 1 / I against the GEMM CTAs. The
// constant comes from the H200 comm-CTA sweeps of every catalogue shape at one rank with rows combined
// (docs/results.md: best 8 of 132 at I = 3072, 10 at 2048, 16 at 1536, >= 32 at 768, <= 4 at 14336).
int default_comm_ctas(int ctas, int64_t intermediate) {
  const double per_gemm_cta = 190.0 / double(intermediate);
  return std::clamp(int(std::lround(ctas * per_gemm_cta / (1 + per_gemm_cta))), 1, std::max(1, ctas / 2));
}

// Communication CTAs of a rank in place: they only dispatch, then run GEMM tiles, so too many cost
// little. Empirical (H200, every catalogue shape, 132 CTAs): with the candidates timed in shuffled
// order (docs/results.md, 67d2f73) 6 to 40 lie within ~4% of each other, except 4 KB rows, which need
// 12 or more; ~380 / H per CTA (7 at H 7168, 12 at 4096, 24 at 2048) sits inside that range everywhere.
int in_place_comm_ctas(int ctas, int64_t hidden) {
  return std::clamp(int(std::lround(ctas * 380.0 / double(hidden))), 1, std::max(1, ctas / 2));
}

// Counter words of one rank, in this order inside the rank's slice of counters_.
struct CounterLayout {
  int64_t m_blocks;
  int64_t dispatched() const { return 0; }
  int64_t gemm1_done() const { return m_blocks; }
  int64_t gemm2_done() const { return 2 * m_blocks; }
  int64_t combined() const { return 3 * m_blocks; }
  int64_t elementwise_done() const { return 4 * m_blocks; }  // queues with items: the E4M3 forward, the backward
  int64_t control() const { return 5 * m_blocks; }
  int64_t words() const { return control() + kControlWords; }
};

}  // namespace

FusedLayer::FusedLayer(const EpConfig& config, const FusedMoeOptions& options) : config_(config) {
  setup(config, options, /*launch_ranks=*/config.ranks, /*first_rank=*/0);
  // Virtual ranks: every rank's symmetric buffers in this GPU's memory; x and topk_ids stay the caller's.
  const int P = config.ranks;
  const int64_t T = std::max<int64_t>(config.max_tokens_per_rank, 1);
  // Per rank: arrivals [T], start flags [P], the E4M3 forward's x_ready.
  peer_words_ = DeviceBuffer<uint32_t>(P * (T + P + 1));
  token_counts_ = DeviceBuffer<int32_t>(P * P);
  slots_ = DeviceBuffer<__nv_bfloat16>(P * slot_elems_);
  CUDA_CHECK(cudaMemset(peer_words_.data(), 0, peer_words_.bytes()));
  const int64_t H = config.hidden;
  if (fp8_forward_) {  // the quantized tokens of every rank, here
    try {
      fp8_forward_->tokens = DeviceBuffer<uint8_t>(P * T * H);
      fp8_forward_->token_scales = DeviceBuffer<float>(P * T * (H / 128));
    } catch (const Error& e) {
      POUNCE_FAIL("fused MoE: the fp8_forward quantized tokens do not fit: ", e.what());
    }
  }
  for (int r = 0; r < P; ++r) {
    params_.peers.arrivals[r] = peer_words_.data() + r * (T + P + 1);
    params_.peers.start_flags[r] = params_.peers.arrivals[r] + T;
    params_.peers.x_ready[r] = params_.peers.start_flags[r] + P;
    params_.peers.token_counts[r] = token_counts_.data() + r * P;
    params_.peers.slots[r] = params_.in_place ? nullptr : slots_.data() + r * slot_elems_;
    if (fp8_forward_) {
      params_.peers.x_fp8[r] = fp8_forward_->tokens.data() + r * T * H;
      params_.peers.x_scale[r] = fp8_forward_->token_scales.data() + r * T * (H / 128);
    }
  }
  params_.peers_on_this_gpu = 1;
}

FusedLayer::FusedLayer(const EpConfig& config, ncclComm_t comm, const FusedMoeOptions& options) : config_(config) {
  check_config(config);
  POUNCE_REQUIRE(comm != nullptr, "fused MoE: the NCCL communicator is null");
  int rank = 0, ranks = 0;
  NCCL_CHECK(ncclCommUserRank(comm, &rank));
  NCCL_CHECK(ncclCommCount(comm, &ranks));
  POUNCE_REQUIRE(ranks == config.ranks, "fused MoE: the communicator has ", ranks, " ranks, the config ", config.ranks);
  check_same_config_on_every_rank(config, options, comm);
  POUNCE_REQUIRE(!options.fp8_data_gradients || config.ranks == 1,
                 "fused MoE: fp8_data_gradients runs in the backward chain, which a layer across GPUs does not use");
  setup(config, options, /*launch_ranks=*/1, /*first_rank=*/rank);

  // One symmetric window per rank: what the other ranks read (x, topk_ids, token counts) and write
  // (combine slots, arrivals, start flags). NcclWindow hands it out zeroed.
  const int P = config.ranks;
  const int64_t T = std::max<int64_t>(config.max_tokens_per_rank, 1), k = config.topk, H = config.hidden;
  comm::WindowLayout layout;
  // What peers read (x, topk_ids, token counts) is double-buffered by forward parity: a rank writes
  // forward e + 1's copy while a slower peer may still read forward e's (nobody can be two forwards
  // behind: forward e + 1 ends only after every rank has started it).
  std::array<size_t, 2> x_at, ids_at, counts_at;
  for (int parity = 0; parity < 2; ++parity) {
    x_at[parity] = layout.add(T * H * 2);
    ids_at[parity] = layout.add(T * k * 4);
    counts_at[parity] = layout.add(P * 4);
  }
  const size_t slots_at = layout.add(slot_elems_ * 2);
  const size_t arrivals_at = layout.add(T * 4);
  const size_t flags_at = layout.add(P * 4);
  const size_t weights_at = layout.add(T * k * 4);
  const size_t d_topk_at = layout.add(T * k * 4);
  const size_t backward_words_at = layout.add((T + P) * 4);
  // The E4M3 forward's quantized tokens, which peers pull, and the count of this rank's CTAs that wrote
  // their share (PeerView::x_ready). One copy: a rank overwrites it in its next forward only, which
  // starts after every route of its tokens came back, so after every pull of this one.
  const bool fp8 = options.fp8_forward;
  const size_t x_fp8_at = layout.add(fp8 ? T * H : 0);
  const size_t x_scale_at = layout.add(fp8 ? T * (H / 128) * sizeof(float) : 0);
  const size_t x_ready_at = layout.add(sizeof(uint32_t));
  window_ = std::make_unique<comm::NcclWindow>(comm, layout.bytes());
  window_bytes_ = int64_t(layout.bytes());
  window_->require_team_is_communicator("fused MoE");
  const comm::PeerTable& peers = window_->peers();
  for (int r = 0; r < P; ++r) {
    for (int parity = 0; parity < 2; ++parity) {
      window_x_[parity][r] = reinterpret_cast<__nv_bfloat16*>(peers.at(r, x_at[parity]));
      window_ids_[parity][r] = reinterpret_cast<int32_t*>(peers.at(r, ids_at[parity]));
      window_counts_[parity][r] = reinterpret_cast<int32_t*>(peers.at(r, counts_at[parity]));
    }
    params_.peers.slots[r] = params_.in_place ? nullptr : reinterpret_cast<__nv_bfloat16*>(peers.at(r, slots_at));
    params_.peers.arrivals[r] = reinterpret_cast<uint32_t*>(peers.at(r, arrivals_at));
    params_.peers.start_flags[r] = reinterpret_cast<uint32_t*>(peers.at(r, flags_at));
    window_weights_[r] = reinterpret_cast<float*>(peers.at(r, weights_at));
    window_d_topk_[r] = reinterpret_cast<float*>(peers.at(r, d_topk_at));
    window_backward_words_[r] = reinterpret_cast<uint32_t*>(peers.at(r, backward_words_at));
    params_.peers.x_ready[r] = reinterpret_cast<uint32_t*>(peers.at(r, x_ready_at));
    if (fp8) {
      params_.peers.x_fp8[r] = reinterpret_cast<uint8_t*>(peers.at(r, x_fp8_at));
      params_.peers.x_scale[r] = reinterpret_cast<float*>(peers.at(r, x_scale_at));
    }
  }
  params_.peers_on_this_gpu = P == 1;
}

FusedLayer::~FusedLayer() = default;

// Every rank must run the same layer: a mismatch would size buffers differently and read past them.
void FusedLayer::check_same_config_on_every_rank(const EpConfig& c, const FusedMoeOptions& o, ncclComm_t comm) {
  // The options setup() checks are here too: one rank refusing alone would leave the others waiting in
  // the window's collectives. The E4M3 forward's peers wait for x_ready to count every CTA of the owner
  // (as many as their own), so there the CTAs a rank resolves to (its GPU's multiprocessors by default)
  // must agree too.
  const int64_t e4m3_ctas = o.fp8_forward ? resolved_ctas_per_rank(o, /*launch_ranks=*/1) : 0;
  const std::vector<int64_t> mine = {c.ranks,
                                     c.experts,
                                     c.topk,
                                     c.hidden,
                                     c.intermediate,
                                     c.max_tokens_per_rank,
                                     o.minibatch_rows,
                                     o.ring_blocks,
                                     o.ring_bytes,
                                     o.fp8_data_gradients,
                                     o.ctas_per_rank,
                                     o.comm_ctas,
                                     o.engine_rows,
                                     int64_t(o.wait_timeout_ns),
                                     o.fp8_forward,
                                     e4m3_ctas,
                                     c.max_routes_per_rank};
  const char* names[] = {"ranks",
                         "experts",
                         "topk",
                         "hidden",
                         "intermediate",
                         "max_tokens_per_rank",
                         "minibatch_rows",
                         "ring_blocks",
                         "ring_bytes",
                         "fp8_data_gradients",
                         "ctas_per_rank",
                         "comm_ctas",
                         "engine_rows",
                         "wait_timeout_ns",
                         "fp8_forward",
                         "CTAs per rank of the E4M3 forward",
                         "max_routes_per_rank"};
  const size_t n = mine.size();
  DeviceBuffer<int64_t> send(mine), all(n * c.ranks);
  NCCL_CHECK(ncclAllGather(send.data(), all.data(), n, ncclInt64, comm, nullptr));
  CUDA_CHECK(cudaStreamSynchronize(nullptr));
  const std::vector<int64_t> got = all.download();
  for (int r = 0; r < c.ranks; ++r)
    for (size_t i = 0; i < n; ++i)
      POUNCE_REQUIRE(got[r * n + i] == mine[i], "fused MoE: rank ", r, " has ", names[i], " = ", got[r * n + i],
                     ", this rank ", mine[i], ": every rank must build the same layer");
}

void FusedLayer::setup(const EpConfig& config, const FusedMoeOptions& options, int launch_ranks, int first_rank) {
  check_config(config);
  CUDA_CHECK(cudaGetDevice(&device_));
  capacity_ = planner::row_capacity(config);
  const int P = config.ranks;
  POUNCE_REQUIRE(gpu_is_hopper(), "fused MoE needs a Hopper GPU (sm_90a); this one is ",
                 gpu_info().present ? gpu_info().name : gpu_info().why_absent);

  POUNCE_REQUIRE(options.wait_timeout_ns > 0 && options.wait_timeout_ns <= 3'600'000'000'000ull,
                 "fused MoE: wait_timeout_ns = ", options.wait_timeout_ns, " must be in (0, one hour]");
  const int sms = gpu_info().multiprocessors;
  const int ctas = resolved_ctas_per_rank(options, launch_ranks);
  POUNCE_REQUIRE(ctas * launch_ranks <= sms, "fused MoE: ", ctas, " CTAs per rank x ", launch_ranks,
                 " ranks exceeds the GPU's ", sms, " multiprocessors (the kernel needs every CTA resident)");
  // One rank whose ring holds every m-block (the default at one rank) runs in place: nothing combined,
  // communication CTAs only dispatch and then run GEMM tiles. Across ranks they stay communication
  // CTAs all forward.
  POUNCE_REQUIRE(options.ring_blocks >= 0 && options.ring_bytes >= 0, "fused MoE: ring_blocks = ", options.ring_blocks,
                 " and ring_bytes = ", options.ring_bytes, " must not be negative (0: default)");
  const int64_t H = config.hidden, I = config.intermediate;
  POUNCE_REQUIRE(!options.fp8_forward || (H % 128 == 0 && I % 128 == 0),
                 "fused MoE: fp8_forward needs H and I multiples of 128 (E4M3 blocks); H = ", H, ", I = ", I);
  // Across GPUs the backward is always the fused kernel, which pulls bf16 x rows again and never reads
  // the forward's ring.
  POUNCE_REQUIRE(!(options.fp8_forward && options.fused_backward && launch_ranks == P),
                 "fused MoE: fp8_forward's backward on one GPU runs the chain; fused_backward would read the "
                 "forward's ring rows, which are E4M3 there");
  // Bytes of ring per m-block: x, h and out rows (E4M3 forward: x and h in E4M3 with their scales too).
  const int64_t block_bytes =
      kBlockM * (options.fp8_forward ? 3 * H + 3 * I + (H + I) / 128 * int64_t(sizeof(float)) : (2 * H + I) * 2);
  const int64_t all_blocks_bytes = capacity_.max_m_blocks * block_bytes;
  // At one rank a ring_bytes budget picks in place whenever that takes no more memory than the bounded
  // ring plus the combine slots it would need.
  const int64_t slot_elems = std::max<int64_t>(config.max_tokens_per_rank, 1) * config.topk * config.hidden;
  const bool in_place =
      P == 1 && (options.ring_blocks >= capacity_.max_m_blocks ||
                 (options.ring_blocks == 0 &&
                  (options.ring_bytes == 0 || all_blocks_bytes <= options.ring_bytes + 2 * slot_elems)));
  slot_elems_ = in_place ? 0 : slot_elems;
  const int comm = options.comm_ctas > 0 ? options.comm_ctas
                   : in_place            ? in_place_comm_ctas(ctas, config.hidden)
                                         : default_comm_ctas(ctas, config.intermediate);
  POUNCE_REQUIRE(comm >= 1 && comm < ctas, "fused MoE: comm_ctas = ", comm, " must be in [1, ctas_per_rank = ", ctas,
                 ")");
  const int gemm_ctas = ctas - comm;
  POUNCE_REQUIRE(options.engine_rows >= -1 && options.engine_rows <= kBlockM,
                 "fused MoE: engine_rows = ", options.engine_rows, " must be -1 (default) or in [0, ", kBlockM, "]");
  // Balanced for each row length: bf16 rows are 2H bytes, the E4M3 forward's dispatched rows H.
  const int engine_rows = options.engine_rows >= 0 ? options.engine_rows : balanced_engine_rows(config.hidden * 2);
  const int engine_rows_e4m3 = options.engine_rows >= 0 ? options.engine_rows : balanced_engine_rows(config.hidden);

  // Minibatch: two waves of GEMM1 tiles over the compute CTAs (planner/wave_model.h).
  POUNCE_REQUIRE(options.minibatch_rows >= 0, "fused MoE: minibatch_rows = ", options.minibatch_rows,
                 " must not be negative (0: default)");
  const int64_t minibatch_rows = options.minibatch_rows > 0
                                     ? options.minibatch_rows
                                     : planner::minibatch_rows_for({.compute_sms = gemm_ctas}, config.intermediate);
  // A minibatch past every m-block of the capacity is all of them (and fits the kernel's int32).
  const int64_t bpm = std::min(ceil_div(minibatch_rows, kBlockM), std::max<int64_t>(capacity_.max_m_blocks, 1));
  // Ring: at least two minibatches (the tile queue's deadlock-freedom needs it; three for the E4M3
  // forward's queue, whose GEMM2 runs two minibatches behind GEMM1) or everything.
  const int64_t ring_minibatches = options.fp8_forward ? 3 : 2;
  const int64_t min_ring = std::min(ring_minibatches * bpm, capacity_.max_m_blocks);
  // One rank: by default the ring holds every m-block, as the unfused chain's buffers do, and nothing
  // needs combining (in place). Otherwise the ring is bounded by ring_bytes; when that is not set, by
  // 1 GiB or kDefaultRingMinibatches minibatches, whichever is more.
  const int64_t budget_blocks = options.ring_bytes > 0
                                    ? options.ring_bytes / block_bytes
                                    : std::max((int64_t(1) << 30) / block_bytes, kDefaultRingMinibatches * bpm);
  const int64_t default_ring =
      in_place ? capacity_.max_m_blocks : std::max(min_ring, std::min(capacity_.max_m_blocks, budget_blocks));
  int64_t ring = options.ring_blocks > 0 ? options.ring_blocks : default_ring;
  ring = std::min(ring, capacity_.max_m_blocks);
  POUNCE_REQUIRE(ring >= min_ring, "fused MoE: ring_blocks = ", options.ring_blocks, " is below the minimum ", min_ring,
                 " (", ring_minibatches, " minibatches of ", bpm, " m-blocks)");
  ring = std::max<int64_t>(ring, 1);

  FusedParams& p = params_;
  p.ranks = P;
  p.first_rank = first_rank;
  p.launch_ranks = launch_ranks;
  p.experts = config.experts;
  p.local_experts = config.local_experts();
  p.topk = config.topk;
  p.hidden = int32_t(config.hidden);
  p.intermediate = int32_t(config.intermediate);
  p.max_tokens = int32_t(config.max_tokens_per_rank);
  p.chunks_per_rank = int32_t(std::max<int64_t>(1, ceil_div(config.max_tokens_per_rank, planner::kPlannerChunkTokens)));
  p.capacity_rows = capacity_.max_padded_rows;
  p.max_routes = capacity_.max_routes;
  p.ctas_per_rank = ctas;
  p.comm_ctas = comm;
  p.engine_rows = engine_rows;
  p.engine_rows_e4m3 = engine_rows_e4m3;
  p.blocks_per_minibatch = int32_t(bpm);
  p.ring_blocks = int32_t(ring);
  p.wait_timeout_ns = options.wait_timeout_ns;
  backward_replays_ = options.backward_replays;
  fused_backward_enabled_ = options.fused_backward;
  fp8_data_gradients_ = options.fp8_data_gradients;
  fp8_weight_gradients_ = options.fp8_weight_gradients;
  POUNCE_REQUIRE(
      !(fp8_data_gradients_ || fp8_weight_gradients_) || (config.hidden % 128 == 0 && config.intermediate % 128 == 0),
      "fused MoE: ", fp8_data_gradients_ ? "fp8_data_gradients" : "fp8_weight_gradients",
      " needs H and I multiples of 128 (E4M3 blocks); H = ", config.hidden, ", I = ", config.intermediate);
  POUNCE_REQUIRE(!(options.fp8_data_gradients && options.fused_backward),
                 "fused MoE: fp8_data_gradients runs in the backward chain; fused_backward has no FP8 path yet");
  p.steps = counter_steps(config, options.fp8_forward);
  p.fp8 = options.fp8_forward;
  p.stall_rank = -1;
  p.in_place = in_place;
  p.error = errors_.device_sink();

  // This launch's ranks' private buffers: L slices each.
  const int L = launch_ranks;
  const int64_t E = p.local_experts, rows = capacity_.max_padded_rows;
  const int64_t chunks = int64_t(P) * p.chunks_per_rank;
  chunk_counts_ = DeviceBuffer<int32_t>(L * chunks * E);
  expert_routes_ = DeviceBuffer<int32_t>(L * E);
  expert_offsets_ = DeviceBuffer<int32_t>(L * (E + 1));
  row_source_rank_ = DeviceBuffer<int32_t>(L * rows);
  row_token_ = DeviceBuffer<int32_t>(L * rows);
  row_k_ = DeviceBuffer<int32_t>(L * rows);
  minibatch_starts_ = DeviceBuffer<int32_t>(L * (capacity_.max_m_blocks + 2));
  sizes_ = DeviceBuffer<planner::DeviceScheduleSizes>(L);
  topk_tables_ = DeviceBuffer<const int32_t*>(L * P);
  rank_routes_ = DeviceBuffer<int32_t>(capacity_.bounded ? L * P : 0);
  // One rank: the row of every route, for the sums in place and for a kept forward's backward.
  route_row_ = DeviceBuffer<int32_t>(P == 1 ? std::max<int64_t>(config.max_tokens_per_rank * config.topk, 1) : 0);
  route_row_.fill_bytes(0);  // entries of routes a bad id left out stay inside the row buffers
  const CounterLayout layout{capacity_.max_m_blocks};
  counters_ = DeviceBuffer<uint32_t>(L * layout.words());
  const int64_t ring_rows = L * ring * kBlockM;
  // The E4M3 forward keeps its x rows in Fp8Rows: a one-block stand-in keeps x_ring's descriptor valid.
  const int64_t x_ring_rows = options.fp8_forward ? kBlockM : ring_rows;
  shared_rows_ = SharedRows::of(config, launch_ranks);
  const SharedRows::Rings& rings = shared_rows_->rings(ring);
  x_rows_kept_ = in_place && options.keep_x_rows && !options.fp8_forward;
  if (x_rows_kept_ || options.fp8_forward) {
    // Kept in place, the backward reads the x rows from the ring: they stay this layer's until its backward.
    x_ring_ = DeviceBuffer<__nv_bfloat16>(x_ring_rows * config.hidden);
    x_ring_.fill_bytes(0);  // padding rows are never written: start them at zero
    p.x_ring = x_ring_.data();
  } else {
    p.x_ring = shared_rows_->x_ring(ring);  // a backward copies its x rows again
  }
  p.h_ring = rings.h.data();
  p.out_ring = rings.out.data();

  for (int lr = 0; lr < L; ++lr) {
    RankState& rs = p.rank_state[lr];
    rs.rank = first_rank + lr;
    rs.chunk_counts = chunk_counts_.data() + lr * chunks * E;
    rs.expert_routes = expert_routes_.data() + lr * E;
    rs.expert_offsets = expert_offsets_.data() + lr * (E + 1);
    rs.row_source_rank = row_source_rank_.data() + lr * rows;
    rs.row_token = row_token_.data() + lr * rows;
    rs.row_k = row_k_.data() + lr * rows;
    rs.minibatch_starts = minibatch_starts_.data() + lr * (capacity_.max_m_blocks + 2);
    rs.sizes = sizes_.data() + lr;
    rs.topk_table = topk_tables_.data() + lr * P;
    rs.rank_routes = capacity_.bounded ? rank_routes_.data() + lr * P : nullptr;
    uint32_t* c = counters_.data() + lr * layout.words();
    rs.dispatched = c + layout.dispatched();
    rs.gemm1_done = c + layout.gemm1_done();
    rs.gemm2_done = c + layout.gemm2_done();
    rs.combined = c + layout.combined();
    rs.elementwise_done = options.fp8_forward ? c + layout.elementwise_done() : nullptr;
    rs.control = c + layout.control();
    rs.route_row = route_row_.data();  // one rank only
  }
  CUDA_CHECK(cudaMemset(counters_.data(), 0, counters_.bytes()));
  epoch_ = DeviceBuffer<uint32_t>(1);
  epoch_.fill_bytes(0);
  p.epoch_word = epoch_.data();
  kept_record_ = DeviceBuffer<uint64_t>(2);
  kept_record_.fill_bytes(0);
  p.kept_record = kept_record_.data();

  using gemm::kStoreBoxCols, gemm::kStoreBoxRows;
  maps_.x_ring = gemm::make_bf16_tensor_map(p.x_ring, H, x_ring_rows, kBlockK, kBlockM);
  maps_.h_ring_store = gemm::make_bf16_tensor_map(p.h_ring, I, ring_rows, kStoreBoxCols, kStoreBoxRows);
  maps_.h_ring_load = gemm::make_bf16_tensor_map(p.h_ring, I, ring_rows, kBlockK, kBlockM);
  maps_.out_ring_store = gemm::make_bf16_tensor_map(p.out_ring, H, ring_rows, kStoreBoxCols, kStoreBoxRows);
  if (options.fp8_forward) setup_fp8_forward(ring_rows);
}

void FusedLayer::setup_fp8_forward(int64_t ring_rows) {
  const int L = params_.launch_ranks;
  const int64_t H = config_.hidden, I = config_.intermediate, E = config_.local_experts();
  // The quantized tokens are the constructors' to place: a buffer of every virtual rank's, or the window.
  auto s = std::make_unique<Fp8ForwardState>();
  try {
    s->x_ring = DeviceBuffer<uint8_t>(ring_rows * H);
    s->x_ring_scale = DeviceBuffer<float>(H / 128 * ring_rows);
    s->hidden = DeviceBuffer<uint8_t>(ring_rows * I);
    s->hidden_scale = DeviceBuffer<float>(I / 128 * ring_rows);
    for (int lr = 0; lr < L; ++lr) {
      s->w13.emplace_back(E * 2 * I * H);
      s->w13_scale.emplace_back(E * 2 * I / 128 * (H / 128));
      s->w2.emplace_back(E * H * I);
      s->w2_scale.emplace_back(E * H / 128 * (I / 128));
    }
  } catch (const Error& e) {
    POUNCE_FAIL("fused MoE: the fp8_forward rows and weight copies do not fit: ", e.what());
  }
  // Padding rows are never written: start them at zero (and their scales).
  for (auto* rows : {&s->x_ring, &s->hidden}) rows->fill_bytes(0);
  for (auto* scales : {&s->x_ring_scale, &s->hidden_scale}) scales->fill_bytes(0);
  Fp8Rows& f = params_.fp8_rows;
  f = {s->x_ring.data(), s->x_ring_scale.data(), s->hidden.data(), s->hidden_scale.data(), ring_rows, {}, {}};
  maps_.x_ring_fp8 = gemm::make_fp8_tensor_map(s->x_ring.data(), H, ring_rows, 128, kBlockM);
  maps_.hidden_fp8 = gemm::make_fp8_tensor_map(s->hidden.data(), I, ring_rows, 128, kBlockM);
  for (int lr = 0; lr < L; ++lr) {
    f.w13_scale[lr] = s->w13_scale[lr].data();
    f.w2_scale[lr] = s->w2_scale[lr].data();
    maps_.w13_fp8[lr] = gemm::make_fp8_tensor_map(s->w13[lr].data(), H, E * 2 * I, 128, kFp8TileN);
    maps_.w2_fp8[lr] = gemm::make_fp8_tensor_map(s->w2[lr].data(), I, E * H, 128, kFp8TileN);
  }
  fp8_forward_ = std::move(s);
}

int64_t FusedLayer::Fp8ForwardState::bytes() const {
  int64_t total = 0;
  for (size_t b : {tokens.bytes(), x_ring.bytes(), hidden.bytes(), token_scales.bytes(), x_ring_scale.bytes(),
                   hidden_scale.bytes()})
    total += int64_t(b);
  for (const auto* copies : {&w13, &w2})
    for (const auto& w : *copies) total += int64_t(w.bytes());
  for (const auto* copies : {&w13_scale, &w2_scale})
    for (const auto& w : *copies) total += int64_t(w.bytes());
  return total;
}

// After a device error on one GPU: counters start over. Across GPUs the other ranks' words are theirs
// to clear, so a failed multi-GPU layer refuses further forwards and is rebuilt (collectively).
void FusedLayer::reset_counters() {
  CUDA_CHECK(cudaMemset(counters_.data(), 0, counters_.bytes()));
  if (peer_words_.size() > 0) CUDA_CHECK(cudaMemset(peer_words_.data(), 0, peer_words_.bytes()));
  if (window_) {  // one rank (more ranks never reset): its own words
    CUDA_CHECK(cudaMemset(params_.peers.arrivals[0], 0, config_.max_tokens_per_rank * sizeof(uint32_t)));
    CUDA_CHECK(cudaMemset(params_.peers.start_flags[0], 0, sizeof(uint32_t)));
    const int64_t words = std::max<int64_t>(config_.max_tokens_per_rank, 1) + 1;
    CUDA_CHECK(cudaMemset(window_backward_words_[0], 0, words * sizeof(uint32_t)));
    CUDA_CHECK(cudaMemset(params_.peers.x_ready[0], 0, sizeof(uint32_t)));
  }
  CUDA_CHECK(cudaMemset(epoch_.data(), 0, epoch_.bytes()));
  CUDA_CHECK(cudaMemset(kept_record_.data(), 0, kept_record_.bytes()));
  if (fused_backward_) {
    for (auto* words : {&fused_backward_->counters, &fused_backward_->epoch, &fused_backward_->peer_words})
      CUDA_CHECK(cudaMemset(words->data(), 0, words->bytes()));
  }
  CUDA_CHECK(cudaDeviceSynchronize());  // cleared before a forward on any stream reads them
  forwards_ = 0;
  kept_from_ = {};
}

void FusedLayer::set_weights(std::span<const ExpertWeights> ranks) {
  const int L = params_.launch_ranks;
  POUNCE_REQUIRE(int64_t(ranks.size()) == L, "FusedMoe::set_weights: got ", ranks.size(),
                 " ranks' weights, the layer has ", L, L == config_.ranks ? " ranks" : " rank on this GPU");
  const uint64_t E = config_.local_experts(), H = config_.hidden, I = config_.intermediate;
  const int64_t w13_bytes = int64_t(E * 2 * I * H * 2), w2_bytes = int64_t(E * H * I * 2);
  FusedMaps maps = maps_;  // all or nothing: a bad rank leaves the layer's weights as they were
  for (int lr = 0; lr < L; ++lr) {
    const int r = params_.first_rank + lr;
    require_device_tensor(ranks[lr].w13, w13_bytes, device_, "w13", r);
    require_device_tensor(ranks[lr].w2, w2_bytes, device_, "w2", r);
    maps.w13[lr] = gemm::make_bf16_tensor_map(ranks[lr].w13, H, E * 2 * I, kBlockK, kBlockN);
    maps.w2[lr] = gemm::make_bf16_tensor_map(ranks[lr].w2, I, E * H, kBlockK, kBlockN);
  }
  maps_ = maps;
  fp8_fresh_ = false;  // the copies are of the weights before
  std::copy(ranks.begin(), ranks.end(), weights_.begin());
  has_weights_ = true;
}

void FusedLayer::refresh_fp8_weights(cudaStream_t stream) {
  POUNCE_REQUIRE(fp8_data_gradients_ || fp8_forward_,
                 "FusedMoe::refresh_fp8_weights: the layer was made without fp8_data_gradients or fp8_forward");
  POUNCE_REQUIRE(has_weights_, "FusedMoe::refresh_fp8_weights: call set_weights first");
  int device = -1;
  CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_REQUIRE(device == device_, "FusedMoe::refresh_fp8_weights: the layer lives on GPU ", device_,
                 ", the current device is ", device, " (cudaSetDevice first)");
  const int L = params_.launch_ranks;
  fp8_fresh_ = false;  // until every rank's copies are refreshed
  if (fp8_data_gradients_ && fp8_weights_.empty()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    POUNCE_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   "FusedMoe::refresh_fp8_weights: the first refresh allocates the FP8 copies, which a CUDA graph "
                   "capture cannot: refresh once before capturing");
    std::vector<std::unique_ptr<Fp8TransposedWeights>> made;  // all ranks' or none
    for (int lr = 0; lr < L; ++lr)
      made.push_back(
          std::make_unique<Fp8TransposedWeights>(config_.local_experts(), config_.hidden, config_.intermediate));
    fp8_weights_ = std::move(made);
  }
  if (fp8_forward_) {
    const int64_t E = config_.local_experts(), H = config_.hidden, I = config_.intermediate;
    Fp8ForwardState& s = *fp8_forward_;
    for (int lr = 0; lr < L; ++lr) {
      formats::quantize_128x128_device(reinterpret_cast<const uint16_t*>(weights_[lr].w13), E * 2 * I, H,
                                       s.w13[lr].data(), s.w13_scale[lr].data(), stream);
      formats::quantize_128x128_device(reinterpret_cast<const uint16_t*>(weights_[lr].w2), E * H, I, s.w2[lr].data(),
                                       s.w2_scale[lr].data(), stream);
    }
  }
  for (int lr = 0; lr < int(fp8_weights_.size()); ++lr)  // fp8_data_gradients
    fp8_weights_[lr]->refresh(weights_[lr].w13, weights_[lr].w2, stream, params_.first_rank + lr);
  fp8_fresh_ = true;
}

// Host-visible checks of one rank's tensors, before anything of the forward is enqueued.
void FusedLayer::check_io(const RankIO& io, int r) const {
  POUNCE_REQUIRE(io.tokens >= 0 && io.tokens <= config_.max_tokens_per_rank, "FusedMoe::forward: rank ", r, " has ",
                 io.tokens, " tokens, outside [0, max_tokens_per_rank = ", config_.max_tokens_per_rank, "]");
  const int64_t T = io.tokens, H = config_.hidden, k = config_.topk;
  require_device_tensor(io.x, T * H * 2, device_, "x", r);
  require_device_tensor(io.topk_ids, T * k * 4, device_, "topk_ids", r);
  require_device_tensor(io.topk_weights, T * k * 4, device_, "topk_weights", r);
  require_device_tensor(io.y, T * H * 2, device_, "y", r);
}

void FusedLayer::forward(std::span<const RankIO> ranks, cudaStream_t stream, bool keep_for_backward) {
  POUNCE_REQUIRE(has_weights_, "FusedMoe::forward: call set_weights first");
  int device = -1;
  CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_REQUIRE(device == device_, "FusedMoe::forward: the layer lives on GPU ", device_, ", the current device is ",
                 device, " (cudaSetDevice first)");
  POUNCE_REQUIRE(!errors_.has_error(),
                 "FusedMoe::forward: an earlier forward reported a device error that "
                 "check_device_errors() has not collected: ",
                 errors_.describe());
  POUNCE_REQUIRE(!failed_, "FusedMoe::forward: this layer failed in an earlier forward (", failed_reason_,
                 "); across GPUs its counters cannot be reset alone: rebuild the layer on every rank");
  const int L = params_.launch_ranks;
  POUNCE_REQUIRE(int64_t(ranks.size()) == L, "FusedMoe::forward: got ", ranks.size(), " ranks' tensors, the layer has ",
                 L, L == config_.ranks ? " ranks" : " rank on this GPU");
  for (int lr = 0; lr < L; ++lr) check_io(ranks[lr], params_.first_rank + lr);
  POUNCE_REQUIRE(!fp8_forward_ || fp8_fresh_,
                 "FusedMoe::forward: fp8_forward needs refresh_fp8_weights() after set_weights (and after every "
                 "update of the weights)");

  if (keep_for_backward) {
    if (gate_up_kept_.size() == 0) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      POUNCE_REQUIRE(capture == cudaStreamCaptureStatusNone,
                     "FusedMoe::forward: the first forward that keeps its rows for the backward allocates them, "
                     "which a CUDA graph capture cannot: run one before capturing");
      const int64_t rows = std::max<int64_t>(L * capacity_.max_padded_rows, kBlockM);
      POUNCE_REQUIRE(rows <= INT32_MAX, "FusedMoe::forward: the kept gate/up rows of ", L, " ranks (", rows,
                     ") exceed what a tensor map addresses (2^31)");
      try {
        gate_up_kept_ = DeviceBuffer<__nv_bfloat16>(rows * 2 * config_.intermediate);
      } catch (const Error& e) {
        POUNCE_FAIL("FusedMoe::forward: the gate/up rows kept for the backward (", rows,
                    " rows: ", planner::describe_capacity(config_), ") do not fit: ", e.what(),
                    "; a smaller max_routes_per_rank or max_tokens_per_rank shrinks them");
      }
      maps_.gate_up_kept = gemm::make_bf16_tensor_map(gate_up_kept_.data(), 2 * config_.intermediate, rows,
                                                      gemm::kStoreBoxCols, gemm::kStoreBoxRows);
    }
  }
  if (window_) {
    // The window's double buffers alternate with the host's count of forwards, which a graph replay
    // would not advance.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    POUNCE_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   "FusedMoe::forward: a layer over NCCL cannot be captured "
                   "in a CUDA graph yet (virtual ranks on one GPU can)");
  }
  const int parity = int((forwards_ + 1) % 2);  // of the forward about to run
  if (window_) {
    for (int r = 0; r < config_.ranks; ++r) {
      params_.peers.x[r] = window_x_[parity][r];
      params_.peers.topk_ids[r] = window_ids_[parity][r];
      params_.peers.token_counts[r] = window_counts_[parity][r];
    }
  }
  for (int lr = 0; lr < L; ++lr) {
    const RankIO& io = ranks[lr];
    const int r = params_.first_rank + lr;
    RankState& rs = params_.rank_state[lr];
    rs.tokens = int32_t(io.tokens);
    rs.x = io.x;
    rs.topk_weights = io.topk_weights;
    rs.y = io.y;
    if (window_) {  // peers read this rank's tokens from its symmetric window
      if (io.tokens > 0) {
        CUDA_CHECK(cudaMemcpyAsync(window_x_[parity][r], io.x, io.tokens * config_.hidden * sizeof(__nv_bfloat16),
                                   cudaMemcpyDeviceToDevice, stream));
        CUDA_CHECK(cudaMemcpyAsync(window_ids_[parity][r], io.topk_ids, io.tokens * config_.topk * sizeof(int32_t),
                                   cudaMemcpyDeviceToDevice, stream));
      }
    } else {
      params_.peers.x[r] = io.x;
      params_.peers.topk_ids[r] = io.topk_ids;
    }
  }
  params_.keep_gate_up = keep_for_backward;
  params_.kept_fingerprint = fingerprint(ranks);
  ++forwards_;
  kept_from_ = {};
  if (keep_for_backward) {
    kept_from_.forward = forwards_;
    std::copy(ranks.begin(), ranks.end(), kept_from_.io.begin());
    kept_from_.weights = weights_;
  }
  const SharedRows::Use use(*shared_rows_, stream);  // the hidden and output rings are this forward's
  launch_fused_moe(params_, maps_, stream);
}

// Identifies a forward's inputs and weights (pointers and token counts), for the device-side check that
// the kept rows a backward starts from are its forward's.
uint64_t FusedLayer::fingerprint(std::span<const RankIO> inputs) const {
  uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&h](uint64_t v) { h = (h ^ v) * 0x100000001b3ull; };
  for (size_t lr = 0; lr < inputs.size(); ++lr) {
    for (const void* p : {static_cast<const void*>(inputs[lr].x), static_cast<const void*>(inputs[lr].topk_ids),
                          static_cast<const void*>(inputs[lr].topk_weights), static_cast<const void*>(weights_[lr].w13),
                          static_cast<const void*>(weights_[lr].w2)})
      mix(reinterpret_cast<uintptr_t>(p));
    mix(uint64_t(inputs[lr].tokens));
  }
  return h;
}

// Whether the latest forward kept its rows, on these inputs and the current weights.
bool FusedLayer::kept_forward_matches(std::span<const RankIO> inputs) const {
  if (kept_from_.forward == 0 || kept_from_.forward != forwards_) return false;
  for (size_t lr = 0; lr < inputs.size(); ++lr) {
    const RankIO &kept = kept_from_.io[lr], &in = inputs[lr];
    if (kept.x != in.x || kept.topk_ids != in.topk_ids || kept.topk_weights != in.topk_weights ||
        kept.tokens != in.tokens || kept_from_.weights[lr].w13 != weights_[lr].w13 ||
        kept_from_.weights[lr].w2 != weights_[lr].w2)
      return false;
  }
  return true;
}

// What the latest forward kept for one rank of this launch: its schedule, its gate/up rows, and, in
// place with keep_x_rows, its x rows (the ring holds every row, in schedule order).
KeptForward FusedLayer::kept_rows(int lr) const {
  const int64_t rows = capacity_.max_padded_rows, E = config_.local_experts();
  return {expert_offsets_.data() + lr * (E + 1),
          expert_routes_.data() + lr * E,
          row_source_rank_.data() + lr * rows,
          row_token_.data() + lr * rows,
          row_k_.data() + lr * rows,
          config_.ranks == 1 ? route_row_.data() : nullptr,
          x_rows_kept_ ? x_ring_.data() : nullptr,
          gate_up_kept_.data() + lr * rows * 2 * config_.intermediate};
}

void FusedLayer::backward(std::span<const RankIO> forward_inputs, std::span<const RankGrads> grads,
                          WeightGradOutput mode, cudaStream_t stream) {
  POUNCE_REQUIRE(has_weights_, "FusedMoe::backward: call set_weights first");
  POUNCE_REQUIRE(!failed_, "FusedMoe::backward: this layer failed in an earlier forward or backward (", failed_reason_,
                 "); across GPUs its counters cannot be reset alone: rebuild the layer on every rank");
  POUNCE_REQUIRE(!errors_.has_error(),
                 "FusedMoe::backward: a forward reported a device error that check_device_errors() has not "
                 "collected: ",
                 errors_.describe());
  const int L = params_.launch_ranks;
  POUNCE_REQUIRE(int64_t(forward_inputs.size()) == L && int64_t(grads.size()) == L, "FusedMoe::backward: got ",
                 forward_inputs.size(), " ranks' forward inputs and ", grads.size(),
                 " ranks' gradients, the layer has ", L, L == 1 ? " rank" : " ranks");
  int device = -1;
  CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_REQUIRE(device == device_, "FusedMoe::backward: the layer lives on GPU ", device_, ", the current device is ",
                 device, " (cudaSetDevice first)");
  if (!backward_) {
    // More ranks: dx rows travel back through the forward's combine slots, free once it is done.
    std::vector<__nv_bfloat16*> slots;
    if (config_.ranks > 1) slots.assign(params_.peers.slots, params_.peers.slots + config_.ranks);
    backward_ = std::make_unique<BackwardChain>(
        config_, slots, std::shared_ptr<BackwardRowBuffers>(shared_rows_, &shared_rows_->backward()));
    if (timeline_) backward_->set_timeline(backward_timeline());
  }
  std::vector<BackwardSource> sources(L);
  for (int lr = 0; lr < L; ++lr) {
    const RankIO& in = forward_inputs[lr];
    const RankGrads& g = grads[lr];
    sources[lr] = {in.x, in.topk_ids, in.topk_weights, in.tokens, g.dy, g.dx, g.d_topk_weights};
  }
  POUNCE_REQUIRE(!fp8_data_gradients_ || fp8_fresh_,
                 "FusedMoe::backward: fp8_data_gradients needs refresh_fp8_weights() after set_weights (and after "
                 "every update of the weights)");
  std::vector<ExpertGradients> experts(L);
  for (int lr = 0; lr < L; ++lr) {
    experts[lr] = {weights_[lr].w13,
                   weights_[lr].w2,
                   grads[lr].dw13,
                   grads[lr].dw2,
                   mode,
                   fp8_data_gradients_ ? fp8_weights_[lr].get() : nullptr,
                   fp8_weight_gradients_};
    if (L == config_.ranks) {
      backward_->check(params_.first_rank + lr, sources, experts[lr]);  // every rank before any is enqueued
    } else {                                                            // a rank across GPUs sees only its own tensors
      backward_->check_source(params_.first_rank + lr, sources[lr]);
      backward_->check_experts(params_.first_rank + lr, experts[lr]);
    }
  }
  // Across GPUs only the fused backward exists, from kept rows (its replay would need the chain). Like
  // the forward there, it cannot be captured: the window buffers it uses alternate with the host's count
  // of forwards, which a graph replay would not advance.
  const bool across_gpus = window_ && config_.ranks > 1;
  if (across_gpus) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    POUNCE_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   "FusedMoe::backward: a layer across GPUs cannot be captured in a CUDA graph");
  }
  const bool kept = kept_forward_matches(forward_inputs);
  POUNCE_REQUIRE(kept || !across_gpus,
                 "FusedMoe::backward: no kept forward for these inputs (the latest forward did not keep its rows, "
                 "or ran on other inputs or weights); across GPUs the backward starts only from the rows of a "
                 "forward called with keep_for_backward right before");
  POUNCE_REQUIRE(kept || backward_replays_,
                 "FusedMoe::backward: no kept forward for these inputs (the latest forward did not keep its rows, "
                 "or ran on other inputs or weights), and this layer does not replay forwards "
                 "(FusedMoeOptions::backward_replays = false): call forward with keep_for_backward right before");
  // The host's view misses forwards replayed by CUDA graphs: the device checks the rows are still these.
  if (kept) launch_check_kept_forward(params_, fingerprint(forward_inputs), stream);
  last_backward_replayed_ = !kept;
  const SharedRows::Use use(*shared_rows_, stream);  // the route rows are this backward's
  if (kept && (fused_backward_enabled_ || across_gpus))
    return fused_backward(forward_inputs, grads, sources, experts, stream);
  for (int lr = 0; lr < L; ++lr) {
    const KeptForward rows = kept_rows(lr);
    backward_->run(params_.first_rank + lr, sources, experts[lr], kept ? &rows : nullptr, stream);
  }
  backward_->finish(sources, stream);
}

// Timeline kernel tags: the forward, then the backward chain's GEMMs in BackwardGemm order, then the fused
// backward.
constexpr uint8_t kForwardKernel = 0, kFirstBackwardKernel = 1, kFusedBackwardKernel = 1 + kBackwardGemms;

int64_t FusedLayer::FusedBackwardState::bytes() const {
  return int64_t(counters.bytes() + epoch.bytes() + peer_words.bytes());
}

// The forward's minibatch, at least kBackwardMinibatchBlocks m-blocks: a step's dgrad tiles of one
// n-block read the same weight columns (K up to 2I long), so its m-blocks are what shares them in L2, as
// a band of the stand-alone engine does; the backward's ring holds every m-block, so a longer step only
// lengthens the opening (the first minibatch's dy rows, pulled before the queue starts).
int64_t FusedLayer::backward_minibatch_rows() const {
  const int64_t blocks = std::max<int64_t>(params_.blocks_per_minibatch, kBackwardMinibatchBlocks);
  return std::min(blocks, std::max<int64_t>(capacity_.max_m_blocks, 1)) * kBlockM;
}

// The backward from a kept forward: one persistent launch for the data path (the forward's kernel with
// dy in place of x: moe/fused_kernel.cu), then each rank's weight gradients from the rows it left. The
// launch plans again: the planner gives the kept forward's schedule bit for bit. On virtual ranks the
// peers' tensors are the callers'; across GPUs (NCCL) they are in the symmetric window:
//   dy           in the x buffer of the parity the kept forward did not use. It held the forward before
//                it, which every rank has finished (they all started the kept one). It is overwritten
//                next by the forward after this backward, on this rank, after this backward's kernel,
//                which ends only once every route of its tokens came back, so once every peer pulled
//                its dy rows.
//   topk_ids, token counts   the kept forward's, still in its parity's buffers.
//   router weights, their gradients   window buffers of their own; the gradients are copied out after
//                the kernel, whose sums waited for every route of every token.
//   dx rows      into the forward's combine slots, free once every rank started this backward.
void FusedLayer::fused_backward(std::span<const RankIO> forward_inputs, std::span<const RankGrads> grads,
                                std::span<const BackwardSource> sources, std::span<const ExpertGradients> experts,
                                cudaStream_t stream) {
  const int L = params_.launch_ranks, P = config_.ranks;
  const int64_t H = config_.hidden, I = config_.intermediate, E = config_.local_experts();
  const int64_t M = capacity_.max_m_blocks, ring_rows = L * M * kBlockM;
  const int64_t T = std::max<int64_t>(config_.max_tokens_per_rank, 1);
  const CounterLayout layout{M};
  // The rows are shared (moe/shared_rows.h): made by the first fused backward of a layer of this shape.
  // The kernel writes every row before it reads it, except dy's padding rows: the first GEMM reads them
  // before their S items zero them for the weight gradients. They start zero, and hold zeros or another
  // layer's dy rows later (what the GEMM makes of them lands in padding rows too).
  BackwardRowBuffers::Fused& fused_rows = shared_rows_->backward().fused;
  const bool make_rows = fused_rows.dy_rows.size() == 0;
  // The x rows of the weight gradients: kept in place, or copied again by the kernel's X items into
  // fused_rows.x_rows (made by the first layer of the set that needs them).
  const bool pull_x = !x_rows_kept_;
  const bool make_x_rows = pull_x && fused_rows.x_rows.size() == 0;
  if (!fused_backward_ || make_rows || make_x_rows) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    POUNCE_REQUIRE(capture == cudaStreamCaptureStatusNone,
                   "FusedMoe::backward: the first backward from a kept forward allocates its rows, which a CUDA graph "
                   "capture cannot: run one before capturing");
  }
  if (make_rows) {
    BackwardRowBuffers::Fused made;  // moved into place only once all of it fits
    try {
      made.dy_rows = DeviceBuffer<__nv_bfloat16>(ring_rows * H);
      made.da = DeviceBuffer<__nv_bfloat16>(ring_rows * I);
      made.dgu = DeviceBuffer<__nv_bfloat16>(ring_rows * 2 * I);
      made.wa = DeviceBuffer<__nv_bfloat16>(ring_rows * I);
      made.dx_rows = DeviceBuffer<__nv_bfloat16>(ring_rows * H);
      made.segment_dots = DeviceBuffer<float>(ring_rows * backward::segments_per_row(I / 8));
      made.row_weight = DeviceBuffer<float>(ring_rows);
    } catch (const Error& e) {
      POUNCE_FAIL("FusedMoe::backward: the fused backward's row buffers (", ring_rows,
                  " rows: ", planner::describe_capacity(config_), ") do not fit: ", e.what(),
                  "; a smaller max_routes_per_rank or max_tokens_per_rank shrinks them");
    }
    made.dy_rows.fill_bytes(0);
    fused_rows = std::move(made);  // no x rows yet: they are made after the first rows
  }
  if (make_x_rows) {
    try {
      fused_rows.x_rows = DeviceBuffer<__nv_bfloat16>(ring_rows * H);
    } catch (const Error& e) {
      POUNCE_FAIL("FusedMoe::backward: the fused backward's x rows (", ring_rows,
                  " rows: ", planner::describe_capacity(config_), ") do not fit: ", e.what(),
                  "; keep_x_rows, or a smaller max_routes_per_rank or max_tokens_per_rank, avoids them");
    }
  }
  if (!fused_backward_) {
    auto s = std::make_unique<FusedBackwardState>();
    s->counters = DeviceBuffer<uint32_t>(L * layout.words());
    s->epoch = DeviceBuffer<uint32_t>(1);
    s->peer_words = DeviceBuffer<uint32_t>(P * (T + P));
    for (auto* words : {&s->counters, &s->epoch, &s->peer_words}) words->fill_bytes(0);
    fused_backward_ = std::move(s);
  }
  FusedBackwardState& s = *fused_backward_;

  FusedParams p = params_;
  p.backward = 1;
  p.fp8 = 0;
  p.keep_gate_up = 0;
  p.stall_rank = -1;
  p.ring_blocks = int32_t(M);
  p.blocks_per_minibatch = int32_t(backward_minibatch_rows() / kBlockM);
  p.in_place = P == 1;
  if (P == 1 && !params_.in_place) p.comm_ctas = in_place_comm_ctas(p.ctas_per_rank, H);
  p.steps = backward_counter_steps(config_);
  p.epoch_word = s.epoch.data();
  p.x_ring = fused_rows.dy_rows.data();
  p.h_ring = fused_rows.da.data();
  p.out_ring = fused_rows.dx_rows.data();
  if (timeline_) p.timeline.kernel = kFusedBackwardKernel;
  p.bwd = {gate_up_kept_.data(),
           fused_rows.dgu.data(),
           fused_rows.wa.data(),
           {},
           {},
           fused_rows.segment_dots.data(),
           fused_rows.row_weight.data(),
           {},
           pull_x ? fused_rows.x_rows.data() : nullptr,
           pull_x ? fused_rows.x_rows.data() : kept_rows(0).x_rows,
           0,
           weight_grad_epilogue(experts[0].mode)};
  // With bf16 weight gradients the kernel runs them too, from the x rows kept in place or pulled by its X
  // items (with more ranks, a bounded forward ring or keep_x_rows = false); E4M3 weight gradients
  // quantize their rows first, after the kernel.
  bool fp8_weight_gradients = false;
  for (int lr = 0; lr < L; ++lr) fp8_weight_gradients |= experts[lr].fp8_weight_gradients;
  p.bwd.weight_grads = p.bwd.wgrad_x_rows != nullptr && !fp8_weight_gradients;
  const int kept_parity = int(forwards_ % 2), dy_parity = 1 - kept_parity;
  const int rank = params_.first_rank;
  if (window_) {
    const RankIO& in = forward_inputs[0];
    if (in.tokens > 0) {
      CUDA_CHECK(cudaMemcpyAsync(window_x_[dy_parity][rank], grads[0].dy, in.tokens * H * sizeof(__nv_bfloat16),
                                 cudaMemcpyDeviceToDevice, stream));
      CUDA_CHECK(cudaMemcpyAsync(window_weights_[rank], in.topk_weights, in.tokens * config_.topk * sizeof(float),
                                 cudaMemcpyDeviceToDevice, stream));
    }
    for (int r = 0; r < P; ++r) {  // topk_ids and token counts: the kept forward's, in params_ already
      p.peers.x[r] = window_x_[dy_parity][r];
      p.peers.arrivals[r] = window_backward_words_[r];
      p.peers.start_flags[r] = p.peers.arrivals[r] + T;
      p.bwd.topk_weights[r] = window_weights_[r];
      p.bwd.d_topk_weights[r] = window_d_topk_[r];
      p.bwd.x_source[r] = window_x_[kept_parity][r];
    }
  } else {
    for (int r = 0; r < P; ++r) {  // virtual ranks: launch rank r is rank r
      p.peers.x[r] = grads[r].dy;
      p.peers.topk_ids[r] = forward_inputs[r].topk_ids;
      p.peers.arrivals[r] = s.peer_words.data() + r * (T + P);
      p.peers.start_flags[r] = p.peers.arrivals[r] + T;
      p.bwd.topk_weights[r] = forward_inputs[r].topk_weights;
      p.bwd.d_topk_weights[r] = grads[r].d_topk_weights;
      p.bwd.x_source[r] = forward_inputs[r].x;
    }
  }
  for (int lr = 0; lr < L; ++lr) {
    RankState& rs = p.rank_state[lr];
    rs.tokens = int32_t(forward_inputs[lr].tokens);
    rs.topk_weights = nullptr;
    rs.y = grads[lr].dx;
    uint32_t* c = s.counters.data() + lr * layout.words();
    rs.dispatched = c + layout.dispatched();
    rs.gemm1_done = c + layout.gemm1_done();
    rs.gemm2_done = c + layout.gemm2_done();
    rs.combined = c + layout.combined();
    rs.elementwise_done = c + layout.elementwise_done();
    rs.control = c + layout.control();
  }
  FusedMaps maps{};
  using gemm::make_bf16_tensor_map, gemm::kStoreBoxCols, gemm::kStoreBoxRows;
  maps.x_ring = make_bf16_tensor_map(fused_rows.dy_rows.data(), H, ring_rows, kBlockK, kBlockM);
  maps.h_ring_store = make_bf16_tensor_map(fused_rows.da.data(), I, ring_rows, kStoreBoxCols, kStoreBoxRows);
  maps.h_ring_load = make_bf16_tensor_map(fused_rows.dgu.data(), 2 * I, ring_rows, kBlockK, kBlockM);
  maps.out_ring_store = make_bf16_tensor_map(fused_rows.dx_rows.data(), H, ring_rows, kStoreBoxCols, kStoreBoxRows);
  for (int lr = 0; lr < L; ++lr) {  // the weights read N-major: [E * K, N], boxes 64 wide
    maps.w2[lr] = make_bf16_tensor_map(weights_[lr].w2, I, E * H, 64, kBlockK);
    maps.w13[lr] = make_bf16_tensor_map(weights_[lr].w13, H, E * 2 * I, 64, kBlockK);
  }
  if (p.bwd.weight_grads) {  // as the stand-alone k-grouped GEMM reads and writes them
    const bool fp32 = p.bwd.weight_grad_epilogue != gemm::Epilogue::kStore;
    const uint32_t out_box = fp32 ? 32 : kStoreBoxCols;
    maps.wgrad_dy = make_bf16_tensor_map(fused_rows.dy_rows.data(), H, ring_rows, 64, kBlockK);
    maps.wgrad_wa = make_bf16_tensor_map(fused_rows.wa.data(), I, ring_rows, 64, kBlockK);
    maps.wgrad_dgu = make_bf16_tensor_map(fused_rows.dgu.data(), 2 * I, ring_rows, 64, kBlockK);
    maps.wgrad_x = make_bf16_tensor_map(p.bwd.wgrad_x_rows, H, ring_rows, 64, kBlockK);
    for (int lr = 0; lr < L; ++lr) {
      maps.wgrad_dw2[lr] = gemm::make_3d_tensor_map(experts[lr].dw2, fp32, I, H, E, out_box, kStoreBoxRows);
      maps.wgrad_dw13[lr] = gemm::make_3d_tensor_map(experts[lr].dw13, fp32, H, 2 * I, E, out_box, kStoreBoxRows);
    }
  }
  launch_fused_moe_backward(p, maps, stream);
  if (window_ && forward_inputs[0].tokens > 0)
    CUDA_CHECK(cudaMemcpyAsync(grads[0].d_topk_weights, window_d_topk_[rank],
                               forward_inputs[0].tokens * config_.topk * sizeof(float), cudaMemcpyDeviceToDevice,
                               stream));

  if (p.bwd.weight_grads) return;
  // The x rows of the weight gradients: kept in place, the forward's ring; otherwise the kernel's X
  // items pulled them from the source ranks' kept forward inputs (across GPUs the window copies, which
  // no rank overwrites before the forward after next starts) into fused_rows.x_rows, in schedule order.
  // Either way the kernel's S items zeroed their padding rows (p.bwd.wgrad_x_rows).
  std::vector<const __nv_bfloat16*> x(P);
  for (int r = 0; r < P; ++r) x[r] = window_ ? window_x_[kept_parity][r] : sources[r].x;
  const int64_t rank_rows = M * kBlockM;
  for (int lr = 0; lr < L; ++lr) {
    KeptForward rows = kept_rows(lr);
    if (pull_x) rows.x_rows = fused_rows.x_rows.data() + lr * rank_rows * H;
    backward_->run_weight_gradients(
        rank + lr, x, experts[lr], rows,
        {fused_rows.dy_rows.data() + lr * rank_rows * H, fused_rows.dgu.data() + lr * rank_rows * 2 * I,
         fused_rows.wa.data() + lr * rank_rows * I},
        stream);
  }
}

TimelineSink FusedLayer::backward_timeline() {
  TimelineSink sink = timeline_ ? timeline_->sink() : TimelineSink{};
  sink.kernel = kFirstBackwardKernel;
  return sink;
}

void FusedLayer::start_timeline(int64_t max_events) {
  timeline_ = std::make_unique<Timeline>(max_events);
  params_.timeline = timeline_->sink();
  params_.timeline.kernel = kForwardKernel;
  if (backward_) backward_->set_timeline(backward_timeline());
}

std::string FusedLayer::stop_timeline() {
  POUNCE_REQUIRE(timeline_ != nullptr, "FusedMoe::stop_timeline: no timeline was started");
  std::unique_ptr<Timeline> timeline = std::move(timeline_);
  params_.timeline = {};
  if (backward_) backward_->set_timeline({});
  const std::vector<TimelineEvent> events = timeline->events();
  std::vector<std::string> names = {"fused forward"};
  for (const char* gemm : {"GEMM1 again", "dgrad down", "dgrad gate/up", "wgrad down", "wgrad gate/up"})
    names.push_back(std::string("backward: ") + gemm);
  names.push_back("fused backward");
  return chrome_trace_json(events, names);
}

int64_t FusedLayer::device_bytes() const {
  int64_t bytes = window_bytes_ + (backward_ ? backward_->device_bytes() : 0) +
                  (fused_backward_ ? fused_backward_->bytes() : 0) + shared_rows_->bytes();
  for (size_t b : {chunk_counts_.bytes(), expert_routes_.bytes(), expert_offsets_.bytes(), row_source_rank_.bytes(),
                   row_token_.bytes(), row_k_.bytes(), minibatch_starts_.bytes(), sizes_.bytes(), topk_tables_.bytes(),
                   rank_routes_.bytes(), route_row_.bytes(), counters_.bytes(), x_ring_.bytes(), gate_up_kept_.bytes(),
                   peer_words_.bytes(), token_counts_.bytes(), slots_.bytes()})
    bytes += int64_t(b);
  for (const auto& w : fp8_weights_) bytes += w->device_bytes();
  if (fp8_forward_) bytes += fp8_forward_->bytes();
  return bytes;
}

void FusedLayer::check_device_errors() {
  // The backward's record is read (and cleared) first, but raised only after the forward's has been
  // handled: the forward's counters must be reset whichever of the two failed.
  std::string backward_error;
  if (backward_) {
    try {
      backward_->check_device_errors();
    } catch (const Error& e) {
      backward_error = e.what();
    }
  }
  if (!errors_.has_error()) {
    if (!backward_error.empty()) throw Error(backward_error);
    return;
  }
  // The record is read before anything else: after a trap the context is gone and every CUDA call fails.
  const std::string what = errors_.describe();
  const cudaError_t synced = cudaDeviceSynchronize();
  POUNCE_REQUIRE(synced == cudaSuccess, "kernel stopped: ", what, "; the CUDA context is lost (",
                 cudaGetErrorString(synced), "): the kernel trapped after reporting");
  if (window_ && config_.ranks > 1) {
    failed_ = true;
    failed_reason_ = what;
  } else {
    reset_counters();
  }
  errors_.check();
}

}  // namespace pounce::moe
