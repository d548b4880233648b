#include "moe/fused_moe.h"

#include <algorithm>

#include "common/gpu.h"
#include "gemm/grouped_gemm.h"
#include "gemm/tensor_map.h"
#include "planner/device_planner.h"

namespace pounce::moe {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Counter words of one rank, in this order inside the rank's slice of counters_.
struct CounterLayout {
  int64_t m_blocks, tokens, ranks;
  int64_t dispatched() const { return 0; }
  int64_t gemm1_done() const { return m_blocks; }
  int64_t gemm2_done() const { return 2 * m_blocks; }
  int64_t combined() const { return 3 * m_blocks; }
  int64_t control() const { return 4 * m_blocks; }
  int64_t arrivals() const { return control() + kControlWords; }
  int64_t start_flags() const { return arrivals() + tokens; }
  int64_t words() const { return start_flags() + ranks; }
};

}  // namespace

FusedMoe::FusedMoe(const planner::EpConfig& config, const FusedMoeOptions& options)
    : config_(config), options_(options) {
  capacity_ = planner::worst_case_capacity(config);  // validates the config
  const int P = config.ranks;
  POUNCE_REQUIRE(P <= kMaxRanks, "fused MoE: ", P, " ranks; at most ", kMaxRanks, " (one NVLink node)");
  POUNCE_REQUIRE(config.local_experts() <= planner::kPlannerMaxLocalExperts, "fused MoE: ", config.local_experts(),
                 " local experts per rank; at most ", planner::kPlannerMaxLocalExperts);
  POUNCE_REQUIRE(config.hidden <= 65536 && config.intermediate <= 65536 && config.max_tokens_per_rank < (1 << 24),
                 "fused MoE: hidden ", config.hidden, ", intermediate ", config.intermediate, " or max tokens ",
                 config.max_tokens_per_rank, " too large");
  POUNCE_REQUIRE(gpu_is_hopper(), "fused MoE needs a Hopper GPU (sm_90a); this one is ",
                 gpu_info().present ? gpu_info().name : gpu_info().why_absent);

  const int sms = gpu_info().multiprocessors;
  const int ctas = options.ctas_per_rank > 0 ? options.ctas_per_rank : sms / P;
  POUNCE_REQUIRE(ctas * P <= sms, "fused MoE: ", ctas, " CTAs per rank x ", P, " ranks exceeds the GPU's ", sms,
                 " multiprocessors (the kernel needs every CTA resident)");
  // Default from the H200 comm-CTA sweep (docs/fused_moe.md): 12 of 132 keep dispatch ahead of the GEMMs.
  const int comm = options.comm_ctas > 0 ? options.comm_ctas : std::max(1, ctas / 11);
  POUNCE_REQUIRE(comm >= 1 && comm < ctas, "fused MoE: comm_ctas = ", comm, " must be in [1, ctas_per_rank = ", ctas,
                 ")");
  const int gemm_ctas = ctas - comm;

  // Minibatch: two waves of GEMM1 tiles over the compute CTAs (planner/wave_model.h).
  const int64_t n1_blocks = ceil_div(2 * config.intermediate, gemm::kBlockN);
  const int64_t minibatch_rows = options.minibatch_rows > 0 ? options.minibatch_rows
                                                            : ceil_div(2 * gemm_ctas, n1_blocks) * planner::kBlockM;
  const int64_t bpm = ceil_div(minibatch_rows, planner::kBlockM);
  // Ring: at least two minibatches (the tile queue's deadlock-freedom needs it) or everything.
  const int64_t block_bytes = planner::kBlockM * (2 * config.hidden + config.intermediate) * 2;
  const int64_t min_ring = std::min(2 * bpm, capacity_.max_m_blocks);
  int64_t ring = options.ring_blocks > 0 ? options.ring_blocks
                                         : std::max(min_ring, std::min(capacity_.max_m_blocks, options.ring_bytes / block_bytes));
  ring = std::min(ring, capacity_.max_m_blocks);
  POUNCE_REQUIRE(ring >= min_ring, "fused MoE: ring_blocks = ", options.ring_blocks, " is below the minimum ", min_ring,
                 " (two minibatches of ", bpm, " m-blocks)");
  ring = std::max<int64_t>(ring, 1);

  FusedParams& p = params_;
  p.ranks = P;
  p.first_rank = 0;
  p.launch_ranks = P;
  p.experts = config.experts;
  p.local_experts = config.local_experts();
  p.topk = config.topk;
  p.hidden = int32_t(config.hidden);
  p.intermediate = int32_t(config.intermediate);
  p.max_tokens = int32_t(config.max_tokens_per_rank);
  p.chunks_per_rank = int32_t(std::max<int64_t>(1, ceil_div(config.max_tokens_per_rank, planner::kPlannerChunkTokens)));
  p.capacity_rows = capacity_.max_padded_rows;
  p.ctas_per_rank = ctas;
  p.comm_ctas = comm;
  p.blocks_per_minibatch = int32_t(bpm);
  p.ring_blocks = int32_t(ring);
  p.wait_timeout_ns = options.wait_timeout_ns;
  p.stall_rank = options.stall_rank;
  p.peers_on_this_gpu = 1;
  p.error = errors_.device_sink();

  // Buffers: P slices each.
  const int64_t E = p.local_experts, rows = capacity_.max_padded_rows, T = config.max_tokens_per_rank;
  const int64_t chunks = int64_t(P) * p.chunks_per_rank;
  chunk_counts_ = DeviceBuffer<int32_t>(P * chunks * E);
  expert_routes_ = DeviceBuffer<int32_t>(P * E);
  expert_offsets_ = DeviceBuffer<int32_t>(P * (E + 1));
  row_source_rank_ = DeviceBuffer<int32_t>(P * rows);
  row_token_ = DeviceBuffer<int32_t>(P * rows);
  row_k_ = DeviceBuffer<int32_t>(P * rows);
  minibatch_starts_ = DeviceBuffer<int32_t>(P * (capacity_.max_m_blocks + 2));
  token_counts_ = DeviceBuffer<int32_t>(P * P);
  sizes_ = DeviceBuffer<planner::DeviceScheduleSizes>(P);
  topk_tables_ = DeviceBuffer<const int32_t*>(P * P);
  const CounterLayout layout{capacity_.max_m_blocks, std::max<int64_t>(T, 1), P};
  counters_ = DeviceBuffer<uint32_t>(P * layout.words());
  slots_ = DeviceBuffer<__nv_bfloat16>(P * std::max<int64_t>(T, 1) * config.topk * config.hidden);
  const int64_t ring_rows = P * ring * planner::kBlockM;
  x_ring_ = DeviceBuffer<__nv_bfloat16>(ring_rows * config.hidden);
  h_ring_ = DeviceBuffer<__nv_bfloat16>(ring_rows * config.intermediate);
  out_ring_ = DeviceBuffer<__nv_bfloat16>(ring_rows * config.hidden);
  x_ring_.fill_bytes(0);  // padding rows are never written: start them at zero
  p.x_ring = x_ring_.data();
  p.h_ring = h_ring_.data();
  p.out_ring = out_ring_.data();

  for (int r = 0; r < P; ++r) {
    RankState& rs = p.rank_state[r];
    rs.rank = r;
    rs.chunk_counts = chunk_counts_.data() + r * chunks * E;
    rs.expert_routes = expert_routes_.data() + r * E;
    rs.expert_offsets = expert_offsets_.data() + r * (E + 1);
    rs.row_source_rank = row_source_rank_.data() + r * rows;
    rs.row_token = row_token_.data() + r * rows;
    rs.row_k = row_k_.data() + r * rows;
    rs.minibatch_starts = minibatch_starts_.data() + r * (capacity_.max_m_blocks + 2);
    rs.sizes = sizes_.data() + r;
    rs.topk_table = topk_tables_.data() + r * P;
    uint32_t* c = counters_.data() + r * layout.words();
    rs.dispatched = c + layout.dispatched();
    rs.gemm1_done = c + layout.gemm1_done();
    rs.gemm2_done = c + layout.gemm2_done();
    rs.combined = c + layout.combined();
    rs.control = c + layout.control();
    p.peers.arrivals[r] = c + layout.arrivals();
    p.peers.start_flags[r] = c + layout.start_flags();
    p.peers.token_counts[r] = token_counts_.data() + r * P;
    p.peers.slots[r] = slots_.data() + r * std::max<int64_t>(T, 1) * config.topk * config.hidden;
  }
  reset_counters();

  const uint64_t H = config.hidden, I = config.intermediate;
  maps_.m[0] = gemm::make_bf16_tensor_map(x_ring_.data(), H, ring_rows, gemm::kBlockK, gemm::kBlockM);
  maps_.m[2] = gemm::make_bf16_tensor_map(h_ring_.data(), I, ring_rows, 64, 64);
  maps_.m[3] = gemm::make_bf16_tensor_map(h_ring_.data(), I, ring_rows, gemm::kBlockK, gemm::kBlockM);
  maps_.m[5] = gemm::make_bf16_tensor_map(out_ring_.data(), H, ring_rows, 64, 64);
}

void FusedMoe::reset_counters() {
  CUDA_CHECK(cudaMemset(counters_.data(), 0, counters_.bytes()));
  params_.epoch = 0;
}

void FusedMoe::set_weights(const __nv_bfloat16* w13, const __nv_bfloat16* w2) {
  POUNCE_REQUIRE(w13 && w2, "FusedMoe::set_weights: null weight pointer");
  const uint64_t E = config_.experts, H = config_.hidden, I = config_.intermediate;
  maps_.m[1] = gemm::make_bf16_tensor_map(w13, H, E * 2 * I, gemm::kBlockK, gemm::kBlockN);
  maps_.m[4] = gemm::make_bf16_tensor_map(w2, I, E * H, gemm::kBlockK, gemm::kBlockN);
  has_weights_ = true;
}

void FusedMoe::forward(std::span<const RankIO> ranks, cudaStream_t stream) {
  POUNCE_REQUIRE(has_weights_, "FusedMoe::forward: call set_weights first");
  POUNCE_REQUIRE(int64_t(ranks.size()) == config_.ranks, "FusedMoe::forward: got ", ranks.size(),
                 " ranks' tensors, the layer has ", config_.ranks, " ranks");
  for (int r = 0; r < config_.ranks; ++r) {
    const RankIO& io = ranks[r];
    POUNCE_REQUIRE(io.tokens >= 0 && io.tokens <= config_.max_tokens_per_rank, "FusedMoe::forward: rank ", r, " has ",
                   io.tokens, " tokens, outside [0, max_tokens_per_rank = ", config_.max_tokens_per_rank, "]");
    POUNCE_REQUIRE(io.tokens == 0 || (io.x && io.topk_ids && io.topk_weights && io.y), "FusedMoe::forward: rank ", r,
                   " has ", io.tokens, " tokens but a null x, topk_ids, topk_weights or y");
    RankState& rs = params_.rank_state[r];
    rs.tokens = int32_t(io.tokens);
    rs.topk_weights = io.topk_weights;
    rs.y = io.y;
    params_.peers.x[r] = io.x;
    params_.peers.topk_ids[r] = io.topk_ids;
  }
  ++params_.epoch;
  launch_fused_moe(params_, maps_, stream);
}

void FusedMoe::check_device_errors() {
  if (!errors_.has_error()) return;
  CUDA_CHECK(cudaDeviceSynchronize());
  reset_counters();
  errors_.check();
}

int64_t FusedMoe::routed_rows(int rank) const {
  POUNCE_REQUIRE(rank >= 0 && rank < config_.ranks, "FusedMoe::routed_rows: rank ", rank, " out of range");
  planner::DeviceScheduleSizes s{};
  CUDA_CHECK(cudaMemcpy(&s, sizes_.data() + rank, sizeof(s), cudaMemcpyDeviceToHost));
  return s.padded_rows;
}

}  // namespace pounce::moe
