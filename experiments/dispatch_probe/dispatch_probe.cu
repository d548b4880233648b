// The dispatch probe's kernel and its host side (moe/dispatch_probe.h). Per rank of the launch:
// comm_ctas row-moving CTAs, then one tile-gate CTA whose first thread does the timing.
#include <algorithm>
#include <string>

#include "common/bounded_wait.cuh"
#include "common/cooperative_launch.h"
#include "common/cuda_check.h"
#include "common/gpu.h"
#include "dispatch_probe/dispatch_probe.h"
#include "moe/copy_engine.cuh"
#include "moe/fused_params.h"
#include "moe/row_mover.cuh"
#include "ptx/ptx.cuh"

namespace pounce::moe {
namespace {

constexpr int kThreads = 384;  // the fused kernel's comm CTAs (gemm::pipeline::kThreads), move_rows' CTA
constexpr int kRows = kBlockM;
static_assert(kRows == kBlockM, "an item is at most one m-block, as move_rows' row table");

// One rank of the launch.
struct ProbeRank {
  int32_t rank;
  int32_t items;   // in this run's mode
  int32_t blocks;  // m-blocks this rank receives (the gate waits for them)
  const DispatchItem* item;
  const DispatchRow* row;
  const uint32_t* block_rows;  // push: routed rows per m-block, the ready target
  uint32_t* ticket;
  uint64_t* times;  // t0, t_first, t_all
};

struct ProbeParams {
  int32_t ranks, launch_ranks, comm_ctas, hidden;
  int32_t engine_rows;        // move_rows: rows of each item for the bulk-copy engine
  int32_t push;               // DispatchMode::kPush
  int32_t peers_on_this_gpu;  // every rank on this GPU: push may fence at GPU scope
  int32_t stall_rank;
  uint32_t epoch;  // run number: start flags count up, never cleared
  uint64_t wait_timeout_ns;
  DeviceErrorSink error;
  ProbeRank rank[DispatchPeers::kMaxRanks];
  DispatchPeers peers;
};

struct ProbeShared {
  CopyEngine::Shared engine;
  const void* src[kRows];
  void* dst[kRows];
  DispatchItem item;
  int32_t started;  // the start barrier passed and this rank is not stalled
  int32_t go;       // an item was taken (its own word: thread 0 writes it while others may read started)
};

// Waits until every rank has raised its start flag for this run in our symmetric memory.
__device__ bool all_ranks_started(const ProbeParams& p, const ProbeRank& rs) {
  const WaitSite site{p.error, DeviceRole::kRankSync, p.wait_timeout_ns, rs.rank};
  const uint32_t* flags = p.peers.start_flags[rs.rank];
  for (int q = 0; q < p.ranks; ++q)
    if (!counter_wait_bounded<Scope::kSystem>(&flags[q], p.epoch, site, WaitTarget::kStartFlag, q)) return false;
  return true;
}

// Announces an item's rows in the destination's ready[b].
__device__ void signal_ready(const ProbeParams& p, const DispatchItem& item) {
  uint32_t* ready = &p.peers.ready[item.dest][item.block];
  if (!p.push) {
    // Pull: our own counter, our own GPU's writes: as the fused kernel's dispatched[b].
    ptx::red_release_gpu_add(ready, 1);
    return;
  }
  // Push: the rows went to the destination's memory (a peer GPU, unless all ranks share this one). As the
  // fused combine signals arrivals: one fence orders every row (the engine's completed by flush, the
  // warps' before move_rows' barrier, so cumulative) before a relaxed red, and the destination acquires
  // at the same scope when it sees the count.
  if (p.peers_on_this_gpu)
    ptx::fence_acq_rel_gpu();
  else
    ptx::fence_acq_rel_sys();
  ptx::red_relaxed_sys_add(ready, uint32_t(item.rows));
}

// A row-moving CTA: items from the rank's ticket until none are left, moved as the fused kernel's comm
// CTAs move theirs. Thread 0 takes items; threads 0..127 resolve one row's addresses each into shared
// memory (null past the item's rows), every thread moves them (moe/row_mover.cuh), then thread 0 signals.
// Both modes share this path: pull items have dest = this rank, push items have source = this rank.
__device__ void move_items(const ProbeParams& p, const ProbeRank& rs, ProbeShared& s) {
  CopyEngine engine(s.engine, WaitSite{p.error, DeviceRole::kDispatch, p.wait_timeout_ns, rs.rank});
  if (threadIdx.x == 0) {
    s.started = all_ranks_started(p, rs) && p.stall_rank != rs.rank;
    // Peers' x and rings, ordered by the start flags (generic proxy), before our bulk copies (async proxy).
    ptx::fence_proxy_async_global();
  }
  __syncthreads();  // also: the engine's barriers are initialised
  if (!s.started) return;
  const uint32_t row_bytes = uint32_t(p.hidden) * 2;
  for (;;) {
    if (threadIdx.x == 0) {
      const uint32_t i = atomicAdd(rs.ticket, 1u);
      s.go = i < uint32_t(rs.items);
      if (s.go) s.item = rs.item[i];
    }
    __syncthreads();
    if (!s.go) return;
    const DispatchItem item = s.item;
    if (threadIdx.x < kRows) {
      const int r = threadIdx.x;
      const void* src = nullptr;
      void* dst = nullptr;
      if (r < item.rows) {
        const DispatchRow row = rs.row[item.first_row + r];
        src = p.peers.x[row.source] + int64_t(row.token) * p.hidden;
        dst = p.peers.ring[item.dest] + int64_t(row.ring_row) * p.hidden;
      }
      s.src[r] = src;
      s.dst[r] = dst;
    }
    __syncthreads();
    // Returns after a CTA barrier: every row landed, and nobody reads the table again before the next
    // item's barriers.
    move_rows<kThreads>(engine, s.src, s.dst, row_bytes, p.engine_rows);
    if (threadIdx.x == 0) signal_ready(p, item);
  }
}

// The tile gate (one thread): raises this rank's start flag everywhere, waits for every rank's, then
// times when m-block 0, and then every m-block, is ready — where a GEMM producer would wait.
__device__ void run_tile_gate(const ProbeParams& p, const ProbeRank& rs) {
  for (int q = 0; q < p.ranks; ++q) ptx::st_release_sys(&p.peers.start_flags[q][rs.rank], p.epoch);
  if (!all_ranks_started(p, rs)) return;
  const uint64_t t0 = ptx::globaltimer_ns();
  rs.times[0] = t0;
  rs.times[1] = t0;
  const WaitSite site{p.error, DeviceRole::kTileGate, p.wait_timeout_ns, rs.rank};
  const uint32_t* ready = p.peers.ready[rs.rank];
  for (int32_t b = 0; b < rs.blocks; ++b) {
    const uint32_t target = p.push ? rs.block_rows[b] : 1u;
    // Pushed rows come from other GPUs: acquire at system scope unless every rank is on this GPU.
    const bool ok = p.push && !p.peers_on_this_gpu
                        ? counter_wait_bounded<Scope::kSystem>(&ready[b], target, site, WaitTarget::kMBlockReady, b)
                        : counter_wait_bounded<Scope::kGpu>(&ready[b], target, site, WaitTarget::kMBlockReady, b);
    if (!ok) return;
    if (b == 0) rs.times[1] = ptx::globaltimer_ns();
  }
  rs.times[2] = ptx::globaltimer_ns();
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_probe_kernel(const __grid_constant__ ProbeParams p) {
  extern __shared__ uint8_t smem_raw[];
  ProbeShared& s = *reinterpret_cast<ProbeShared*>((reinterpret_cast<uintptr_t>(smem_raw) + 127) & ~uintptr_t(127));
  const int per_rank = p.comm_ctas + 1;
  const ProbeRank& rs = p.rank[blockIdx.x / per_rank];
  if (int(blockIdx.x % per_rank) < p.comm_ctas)
    move_items(p, rs, s);
  else if (threadIdx.x == 0)
    run_tile_gate(p, rs);
}

constexpr size_t kSharedBytes = sizeof(ProbeShared) + 128;

}  // namespace

DispatchProbe::DispatchProbe(const EpConfig& config, std::span<const std::vector<int32_t>> topk_ids,
                             const DispatchProbeOptions& options)
    : config_(config), options_(options) {
  setup(topk_ids, /*launch_ranks=*/config.ranks, /*first_rank=*/0);
  const int P = config.ranks;
  const int64_t T = std::max<int64_t>(config.max_tokens_per_rank, 1), H = config.hidden;
  const int64_t ring_rows = ring_blocks_ * kRows;
  x_ = DeviceBuffer<__nv_bfloat16>(P * T * H);
  ring_ = DeviceBuffer<__nv_bfloat16>(P * ring_rows * H);
  // Every rank's ready counters first, then every rank's start flags: one memset clears the counters.
  words_ = DeviceBuffer<uint32_t>(P * ring_blocks_ + P * P);
  words_.fill_bytes(0);
  for (int r = 0; r < P; ++r) {
    peers_.x[r] = x_.data() + r * T * H;
    peers_.ring[r] = ring_.data() + r * ring_rows * H;
    peers_.ready[r] = words_.data() + r * ring_blocks_;
    peers_.start_flags[r] = words_.data() + P * ring_blocks_ + r * P;
  }
  peers_on_this_gpu_ = true;
}

DispatchProbe::DispatchProbe(const EpConfig& config, std::span<const std::vector<int32_t>> topk_ids, ncclComm_t comm,
                             const DispatchProbeOptions& options)
    : config_(config), options_(options) {
  int rank = 0, ranks = 0;
  NCCL_CHECK(ncclCommUserRank(comm, &rank));
  NCCL_CHECK(ncclCommCount(comm, &ranks));
  POUNCE_REQUIRE(ranks == config.ranks, "dispatch probe: the communicator has ", ranks, " ranks, the config ",
                 config.ranks);
  setup(topk_ids, /*launch_ranks=*/1, /*first_rank=*/rank);
  const int P = config.ranks;
  const int64_t T = std::max<int64_t>(config.max_tokens_per_rank, 1), H = config.hidden;
  comm::WindowLayout layout;
  const size_t x_at = layout.add(T * H * 2), ring_at = layout.add(ring_blocks_ * kRows * H * 2),
               ready_at = layout.add(ring_blocks_ * 4), flags_at = layout.add(P * 4);
  window_ = std::make_unique<comm::NcclWindow>(comm, layout.bytes());  // zeroed
  window_->require_team_is_communicator("dispatch probe");
  const comm::PeerTable& peers = window_->peers();
  for (int r = 0; r < P; ++r) {
    peers_.x[r] = reinterpret_cast<__nv_bfloat16*>(peers.at(r, x_at));
    peers_.ring[r] = reinterpret_cast<__nv_bfloat16*>(peers.at(r, ring_at));
    peers_.ready[r] = reinterpret_cast<uint32_t*>(peers.at(r, ready_at));
    peers_.start_flags[r] = reinterpret_cast<uint32_t*>(peers.at(r, flags_at));
  }
  peers_on_this_gpu_ = P == 1;
}

DispatchProbe::~DispatchProbe() {
  for (cudaEvent_t e : launch_events_)
    if (e) cudaEventDestroy(e);  // no throw from a destructor
}

// Schedules of every rank (host planner), the ring size, and the items of this GPU's ranks in both modes.
void DispatchProbe::setup(std::span<const std::vector<int32_t>> topk_ids, int launch_ranks, int first_rank) {
  CUDA_CHECK(cudaGetDevice(&device_));
  const int P = config_.ranks;
  POUNCE_REQUIRE(P <= DispatchPeers::kMaxRanks, "dispatch probe: ", P, " ranks; at most ", DispatchPeers::kMaxRanks);
  POUNCE_REQUIRE(gpu_is_hopper(), "dispatch probe needs a Hopper GPU (sm_90a); this one is ",
                 gpu_info().present ? gpu_info().name : gpu_info().why_absent);
  const int comm = options_.comm_ctas;
  POUNCE_REQUIRE(comm >= 1 && launch_ranks * (comm + 1) <= gpu_info().multiprocessors, "dispatch probe: ", comm,
                 " comm CTAs + 1 gate CTA per rank x ", launch_ranks,
                 " ranks must be at least 1 and at most the GPU's ", gpu_info().multiprocessors,
                 " multiprocessors (every CTA must be resident)");
  POUNCE_REQUIRE(options_.wait_timeout_ns > 0 && options_.ring_blocks >= 0,
                 "dispatch probe: wait_timeout_ns = ", options_.wait_timeout_ns,
                 " must be positive and ring_blocks = ", options_.ring_blocks, " not negative");
  POUNCE_REQUIRE(options_.engine_rows >= -1 && options_.engine_rows <= kRows,
                 "dispatch probe: engine_rows = ", options_.engine_rows, " must be -1 (default) or in [0, ", kRows,
                 "]");
  engine_rows_ = options_.engine_rows >= 0 ? options_.engine_rows : balanced_engine_rows(config_.hidden * 2);

  const std::vector<planner::RankSchedule> schedules = dispatch_schedules(config_, topk_ids);
  int64_t most_blocks = 1;
  for (const planner::RankSchedule& s : schedules) most_blocks = std::max(most_blocks, s.m_blocks());
  ring_blocks_ = options_.ring_blocks > 0 ? options_.ring_blocks : most_blocks;
  work_.clear();
  work_.resize(launch_ranks);
  for (int lr = 0; lr < launch_ranks; ++lr) {
    const RankDispatchPlan plan = plan_dispatch(schedules, first_rank + lr, ring_blocks_);
    RankWork& w = work_[lr];
    for (int m = 0; m < 2; ++m) {
      w.items[m] = DeviceBuffer<DispatchItem>(plan.moves[m].items);
      w.rows[m] = DeviceBuffer<DispatchRow>(plan.moves[m].rows);
    }
    w.block_rows = DeviceBuffer<uint32_t>(plan.block_rows);
    w.stats = {.rank = first_rank + lr,
               .blocks = int64_t(plan.block_rows.size()),
               .rows = plan.rows,
               .remote_rows = plan.remote_rows,
               .bytes = plan.rows * config_.hidden * 2};
  }
  first_rank_ = first_rank;
  tickets_ = DeviceBuffer<uint32_t>(launch_ranks);
  times_ = DeviceBuffer<uint64_t>(launch_ranks * 3);
  for (cudaEvent_t& e : launch_events_) CUDA_CHECK(cudaEventCreate(&e));
}

int DispatchProbe::launch_rank(int rank) const {
  const int lr = rank - first_rank_;
  POUNCE_REQUIRE(lr >= 0 && lr < int(work_.size()), "dispatch probe: rank ", rank, " is not on this GPU");
  return lr;
}

__nv_bfloat16* DispatchProbe::x(int rank) const {
  launch_rank(rank);
  return peers_.x[rank];
}

__nv_bfloat16* DispatchProbe::ring(int rank) const {
  launch_rank(rank);
  return peers_.ring[rank];
}

DispatchRun DispatchProbe::run(DispatchMode mode, cudaStream_t stream) {
  int device = -1;
  CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_REQUIRE(device == device_, "dispatch probe: it lives on GPU ", device_, ", the current device is ", device);
  POUNCE_REQUIRE(!failed_, "dispatch probe: an earlier run failed; build a new probe (on every rank)");
  const int L = int(work_.size());
  ProbeParams p{};
  p.ranks = config_.ranks;
  p.launch_ranks = L;
  p.comm_ctas = options_.comm_ctas;
  p.hidden = int32_t(config_.hidden);
  p.engine_rows = engine_rows_;
  p.push = mode == DispatchMode::kPush;
  p.peers_on_this_gpu = peers_on_this_gpu_;
  p.stall_rank = options_.stall_rank;
  p.epoch = ++epoch_;
  p.wait_timeout_ns = options_.wait_timeout_ns;
  p.error = errors_.device_sink();
  p.peers = peers_;
  for (int lr = 0; lr < L; ++lr) {
    const RankWork& w = work_[lr];
    ProbeRank& rs = p.rank[lr];
    rs.rank = first_rank_ + lr;
    rs.items = int32_t(w.items[int(mode)].size());
    rs.blocks = int32_t(w.stats.blocks);
    rs.item = w.items[int(mode)].data();
    rs.row = w.rows[int(mode)].data();
    rs.block_rows = w.block_rows.data();
    rs.ticket = tickets_.data() + lr;
    rs.times = times_.data() + 3 * lr;
    // Cleared each run. Push: a peer writes our counters only after our kernel (stream-ordered after this)
    // raised its start flag, and our previous run ended only once every such write had arrived.
    CUDA_CHECK(cudaMemsetAsync(peers_.ready[rs.rank], 0, ring_blocks_ * sizeof(uint32_t), stream));
  }
  CUDA_CHECK(cudaMemsetAsync(tickets_.data(), 0, tickets_.bytes(), stream));
  CUDA_CHECK(cudaMemsetAsync(times_.data(), 0, times_.bytes(), stream));

  CUDA_CHECK(cudaEventRecord(launch_events_[0], stream));
  // Cooperative: gates and movers wait on each other.
  launch_cooperative(dispatch_probe_kernel, L * (p.comm_ctas + 1), kThreads, kSharedBytes, stream, p);
  CUDA_CHECK(cudaEventRecord(launch_events_[1], stream));
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (errors_.has_error()) {  // the record first: after a trap it says more than the CUDA error
    failed_ = true;
    POUNCE_FAIL("dispatch probe: kernel stopped: ", errors_.describe(),
                synced == cudaSuccess ? "" : "; the CUDA context is lost: the kernel trapped after reporting");
  }
  CUDA_CHECK(synced);
  DispatchRun out;
  float ms = 0;
  CUDA_CHECK(cudaEventElapsedTime(&ms, launch_events_[0], launch_events_[1]));
  out.launch_ms = ms;
  const std::vector<uint64_t> t = times_.download();
  for (int lr = 0; lr < L; ++lr) {
    DispatchRankTimes r = work_[lr].stats;
    r.first_us = double(t[3 * lr + 1] - t[3 * lr]) * 1e-3;
    r.all_us = double(t[3 * lr + 2] - t[3 * lr]) * 1e-3;
    out.ranks.push_back(r);
  }
  return out;
}

}  // namespace pounce::moe
