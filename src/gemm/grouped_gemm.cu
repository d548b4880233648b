// Grouped GEMM kernel for sm_90a. Sections in fixed order: configuration and shared-memory layout,
// producer role, consumer role (mainloop, epilogue), kernel entry, host launcher.
//
// One CTA per SM, clusters of 2 CTAs that compute a pair of m-blocks (tile_scheduler.cuh), 384 threads:
//   warpgroup 0: producer. In CTA rank 0 one thread takes items from the queue, waits for both
//                m-blocks' readiness and publishes each CTA its tile (through distributed shared
//                memory); in both CTAs one thread streams A/B K-slices with TMA into a kStages-deep
//                mbarrier ring. When the pair shares its expert, each CTA loads half of the B tile and
//                multicasts it to both: a third less L2-to-SM traffic per tile.
//   warpgroups 1-2: consumers. Each owns 64 of the tile's 128 rows: wgmma m64n256k16 from shared memory,
//                fp32 accumulators in registers, then the epilogue (SwiGLU, row scale) writes bf16 into
//                a swizzled staging box that a TMA store copies out while the next tile's mainloop runs.
//                A consumer releases a stage to the producers of BOTH CTAs: either may multicast into it.
#include "gemm/grouped_gemm.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>

#include "common/bounded_wait.cuh"
#include "common/cuda_check.h"
#include "common/gpu.h"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ptx.cuh"

namespace pounce::gemm {
namespace {

// ---- configuration and shared memory ---------------------------------------------------------------

constexpr int kStages = 4;
constexpr int kClusterSize = 2;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;  // 64: one wgmma M
constexpr int kStoreBoxCols = 64;  // a TMA store box is 64 bf16 (128 bytes, one swizzle row) wide...
constexpr int kStoreBoxRows = kRowsPerConsumer;  // ...and one consumer's rows high
constexpr int kStoreSlots = 2;     // per consumer: fill one box while the previous one is stored
constexpr int kTileSlots = 2;      // the producer may run one tile ahead of the consumers
constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kBlockK * sizeof(__nv_bfloat16);
// setmaxnreg: 128 x 56 + 256 x 224 = 64512 of the SM's 65536 registers (the producer's tile
// publishing needs more than the usual 40).
constexpr uint32_t kProducerRegisters = 56;
constexpr uint32_t kConsumerRegisters = 224;

// Hardware named barriers; 0 is __syncthreads. One per consumer warpgroup for its epilogue.
enum NamedBarrier : uint32_t { kEpilogueBarrierBase = 1 };

// One CTA's tile of a work item; int4-sized so CTA rank 0 can write its peer's copy in one store.
struct TileInfo {
  int32_t expert, m_block, n_block;
  int32_t flags;  // TileFlags; 0: no more tiles (queue drained, or the producer gave up)
};
enum TileFlags : int32_t {
  kValid = 1,   // compute this tile
  kStore = 2,   // write its output (not for the filler tile of an odd m-block count)
  kShareB = 4,  // both CTAs use the same B tile: load half each and multicast
};

// Every TMA tile starts on a 1024-byte boundary: the 128-byte swizzle pattern repeats every 8 rows
// of 128 bytes and is computed from absolute shared-memory address bits.
struct SharedStorage {
  alignas(1024) __nv_bfloat16 a[kStages][kBlockM * kBlockK];
  alignas(1024) __nv_bfloat16 b[kStages][kBlockN * kBlockK];
  alignas(1024) __nv_bfloat16 c[kConsumerWarpgroups][kStoreSlots][kStoreBoxRows * kStoreBoxCols];
  uint64_t full[kStages];   // TMA bytes landed        (1 local producer arrival + transaction bytes)
  uint64_t empty[kStages];  // consumers done reading  (one arrival per consumer warp of both CTAs)
  uint64_t tile_full[kTileSlots];   // tile published by CTA rank 0's producer
  uint64_t tile_empty[kTileSlots];  // used in rank 0 only: read by every consumer warp and rank 1's producer
  TileInfo tiles[kTileSlots];
};
constexpr size_t kSharedBytes = sizeof(SharedStorage) + 1024;  // + slack to align the dynamic base
static_assert(kSharedBytes <= 232448, "shared memory exceeds the sm_90 per-block limit");
static_assert(kBlockK * sizeof(__nv_bfloat16) == 128, "one K slice row must be one 128-byte swizzle row");

constexpr uint32_t kConsumerWarps = kConsumerWarpgroups * 4;
constexpr uint32_t kStageReleases = kClusterSize * kConsumerWarps;
constexpr uint32_t kTileReleases = kClusterSize * kConsumerWarps + 1;  // + the peer's producer

struct KernelParams {
  int32_t experts, n, k;
  int64_t a_rows;
  const int32_t* expert_offsets;
  const float* row_scale;
  const uint32_t* m_block_ready;
  uint32_t ready_target;
  int32_t multicast;
  int32_t band_pairs;
  uint32_t* ticket;
  DeviceErrorRecord* error;
  uint64_t wait_timeout_ns;
};

// Waits inside the CTA must outlast the producer's readiness wait, which they may sit behind.
__device__ __forceinline__ uint64_t pipeline_timeout_ns(const KernelParams& p) {
  return 2 * p.wait_timeout_ns + 1'000'000'000ull;
}

// ---- producer ----------------------------------------------------------------------------------------

struct LoadMaps {
  const CUtensorMap* a;       // box 128 x 64
  const CUtensorMap* b;       // box 256 x 64
  const CUtensorMap* b_half;  // box 128 x 64, for the multicast halves
};

// CTA rank 0: takes the next item, waits until its m-blocks are ready and gives each CTA its tile.
// Returns this CTA's tile.
__device__ TileInfo publish_next_tile(SharedStorage& s, const KernelParams& p, const PairScheduler& scheduler,
                                      int64_t total_items, uint32_t slot, uint32_t slot_phase) {
  const WaitSite ready_site{p.error, DeviceRole::kGemmProducer, p.wait_timeout_ns};
  const WaitSite pipe_site{p.error, DeviceRole::kGemmProducer, pipeline_timeout_ns(p)};
  TileInfo mine{0, 0, 0, 0}, theirs{0, 0, 0, 0};
  const int64_t item = atomicAdd(p.ticket, 1u);
  if (item < total_items) {
    const PairScheduler::Item it = scheduler.decode(item);
    const int32_t m0 = 2 * it.pair, m1 = m0 + 1;
    const bool m1_real = m1 < scheduler.m_blocks;  // else rank 1 computes a filler tile it never stores
    const int32_t e0 = scheduler.expert_of(m0), e1 = m1_real ? scheduler.expert_of(m1) : e0;
    auto ready = [&](int32_t m) {
      return p.m_block_ready == nullptr ||
             counter_wait_bounded(p.m_block_ready + m, p.ready_target, ready_site, WaitTarget::kMBlockReady, m);
    };
    if (ready(m0) && (!m1_real || ready(m1))) {
      const int32_t share = p.multicast && m1_real && e0 == e1 ? kShareB : 0;
      mine = {e0, m0, it.n_block, kValid | kStore | share};
      theirs = {e1, m1, it.n_block, kValid | (m1_real ? kStore : 0) | share};
    }
  }
  mbarrier_wait_bounded(&s.tile_empty[slot], slot_phase ^ 1, pipe_site, WaitTarget::kTileInfoFree, slot);
  s.tiles[slot] = mine;
  ptx::st_cluster_v4(ptx::map_to_cta(&s.tiles[slot], 1), make_int4(theirs.expert, theirs.m_block, theirs.n_block,
                                                                   theirs.flags));
  // Release at cluster scope: the peer's (cluster-scope) wait on tile_full makes its TileInfo visible.
  ptx::mbarrier_arrive(&s.tile_full[slot]);
  ptx::mbarrier_arrive_cluster<ptx::Scope::kCluster>(ptx::map_to_cta(&s.tile_full[slot], 1));
  return mine;
}

__device__ void run_producer(SharedStorage& s, const LoadMaps& maps, const KernelParams& p, uint32_t rank) {
  ptx::prefetch_tensormap(maps.a);
  ptx::prefetch_tensormap(maps.b);
  ptx::prefetch_tensormap(maps.b_half);
  const WaitSite pipe_site{p.error, DeviceRole::kGemmProducer, pipeline_timeout_ns(p)};
  const int32_t rows_in_use = p.expert_offsets[p.experts];
  const PairScheduler scheduler{p.expert_offsets, p.experts, p.n / kBlockN + (p.n % kBlockN != 0),
                                rows_in_use / kBlockM, p.band_pairs};
  int64_t total_items = scheduler.total_items();
  // The rows in use come from device memory (the planner's output): check them before any load.
  if (rank == 0 && rows_in_use > p.a_rows) {
    report_device_error(p.error, DeviceErrorCode::kBadSchedule, DeviceRole::kGemmProducer,
                        WaitTarget::kRowsInBounds, p.experts, uint64_t(p.a_rows), uint64_t(rows_in_use), 0);
    total_items = 0;
  }

  const int k_blocks = p.k / kBlockK;
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0;
  for (;;) {
    TileInfo tile;
    if (rank == 0) {
      tile = publish_next_tile(s, p, scheduler, total_items, slot, slot_phase);
    } else {
      mbarrier_wait_bounded<ptx::Scope::kCluster>(&s.tile_full[slot], slot_phase, pipe_site, WaitTarget::kTileInfo,
                                                  slot);
      tile = s.tiles[slot];
      ptx::mbarrier_arrive_cluster(ptx::map_to_cta(&s.tile_empty[slot], 0));
    }
    if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
    if (!(tile.flags & kValid)) return;

    // NOTES: A rows were written by other CTAs through the generic proxy and acquired by rank 0's
    // readiness wait (then released to us through the tile barrier); TMA reads through the async proxy,
    // which needs this fence to observe them.
    if (p.m_block_ready != nullptr) ptx::fence_proxy_async_global();
    const int32_t a_row = tile.m_block * kBlockM;
    const int32_t b_row = tile.expert * p.n + tile.n_block * kBlockN;
    for (int kb = 0; kb < k_blocks; ++kb) {
      // The peer multicasts into this stage too, so it must be free in both CTAs: empty counts the
      // consumer warps of both.
      mbarrier_wait_bounded(&s.empty[stage], phase ^ 1, pipe_site, WaitTarget::kStageEmpty, stage);
      ptx::mbarrier_arrive_expect_tx(&s.full[stage], kStageBytes);  // A + B land here, shared or not
      // A rows past the buffer (the filler tile) are out of bounds and zero-filled.
      ptx::tma_load_2d(s.a[stage], maps.a, &s.full[stage], kb * kBlockK, a_row);
      if (tile.flags & kShareB) {
        constexpr int kHalfRows = kBlockN / kClusterSize;
        ptx::tma_load_2d_multicast(s.b[stage] + rank * kHalfRows * kBlockK, maps.b_half, &s.full[stage], kb * kBlockK,
                                   b_row + int32_t(rank) * kHalfRows, (1u << kClusterSize) - 1);
      } else {
        // B rows past the last expert are zero-filled; rows past this expert's N belong to the next
        // expert and only feed output columns the clipped store never writes.
        ptx::tma_load_2d(s.b[stage], maps.b, &s.full[stage], kb * kBlockK, b_row);
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  }
}

// ---- consumer ---------------------------------------------------------------------------------------

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__device__ __forceinline__ void st_shared_bf16x2(uint32_t addr, float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(*reinterpret_cast<uint32_t*>(&v)) : "memory");
}

// Accumulator fragment of wgmma m64nN: warp w of the warpgroup holds rows 16w + lane/4 and that + 8;
// for 8-column chunk j it holds columns 8j + 2*(lane%4) + {0,1} in acc[4j + {0,1}] (first row) and
// acc[4j + {2,3}] (second row). With gate/up interleaved in groups of 8, chunk 2i is gate and chunk
// 2i + 1 the matching up: SwiGLU needs no data exchange between threads.
template <Epilogue kEpilogue>
__device__ void store_tile(const float (&acc)[128], SharedStorage& s, const CUtensorMap* c_map, const KernelParams& p,
                           const TileInfo& tile, int consumer, int thread) {
  constexpr int kOutCols = kEpilogue == Epilogue::kSwiGLU ? kBlockN / 2 : kBlockN;
  constexpr int kBoxes = kOutCols / kStoreBoxCols;
  const int warp = thread / 32, lane = thread % 32;
  const int row = warp * 16 + lane / 4;  // within this consumer's 64 rows; the second row is row + 8
  const int64_t out_row = int64_t(tile.m_block) * kBlockM + consumer * kRowsPerConsumer;
  float scale_lo = 1.0f, scale_hi = 1.0f;
  if (p.row_scale != nullptr) {
    scale_lo = p.row_scale[out_row + row];
    scale_hi = p.row_scale[out_row + row + 8];
  }
  const uint32_t barrier = kEpilogueBarrierBase + consumer;

#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    const int store_slot = box % kStoreSlots;
    const uint32_t base = ptx::smem_addr(s.c[consumer][store_slot]);
    // The store issued from this slot kStoreSlots boxes ago (maybe in the previous tile) must have read it.
    if (thread == 0) ptx::bulk_wait_group_read<kStoreSlots - 1>();
    ptx::named_barrier_sync(barrier, 128);
#pragma unroll
    for (int unit = 0; unit < 8; ++unit) {  // 16-byte unit of the 128-byte box row = 8 output columns
      float v[4];
      if constexpr (kEpilogue == Epilogue::kSwiGLU) {
        constexpr int kChunksPerBox = 16;  // 8 gate + 8 up chunks make one box of outputs
        const int gate = box * kChunksPerBox + 2 * unit;
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = silu(acc[4 * gate + q]) * acc[4 * (gate + 1) + q];
      } else {
        const int chunk = box * 8 + unit;
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = acc[4 * chunk + q];
      }
      // 128-byte swizzle, as the TMA store expects: unit u of row r sits at unit u ^ (r % 8). A warp's
      // 8 rows x 4 lanes then hit 32 different banks.
      const uint32_t offset = uint32_t(((unit ^ (row % 8)) * 16) + (lane % 4) * 4);
      st_shared_bf16x2(base + row * 128 + offset, v[0] * scale_lo, v[1] * scale_lo);
      st_shared_bf16x2(base + (row + 8) * 128 + offset, v[2] * scale_hi, v[3] * scale_hi);
    }
    ptx::fence_proxy_async_shared();  // st.shared (generic proxy) before the TMA store reads (async proxy)
    ptx::named_barrier_sync(barrier, 128);
    if (thread == 0) {
      ptx::tma_store_2d(c_map, s.c[consumer][store_slot], tile.n_block * kOutCols + box * kStoreBoxCols,
                        int32_t(out_row));
      ptx::bulk_commit_group();
    }
  }
}

template <Epilogue kEpilogue>
__device__ void run_consumer(SharedStorage& s, const CUtensorMap* c_map, const KernelParams& p, int consumer,
                             uint32_t rank) {
  const int thread = threadIdx.x % 128, lane = thread % 32;
  // Releases go to both CTAs' barriers; their cluster addresses are fixed.
  const uint32_t peer = rank ^ 1;
  auto release_stage = [&](uint32_t stage) {
    ptx::mbarrier_arrive(&s.empty[stage]);
    ptx::mbarrier_arrive_cluster(ptx::map_to_cta(&s.empty[stage], peer));
  };
  const WaitSite pipe_site{p.error, DeviceRole::kGemmConsumer, pipeline_timeout_ns(p)};
  const int k_blocks = p.k / kBlockK;
  float acc[128];
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0;
  for (;;) {
    mbarrier_wait_bounded<ptx::Scope::kCluster>(&s.tile_full[slot], slot_phase, pipe_site, WaitTarget::kTileInfo,
                                                slot);
    const TileInfo tile = s.tiles[slot];
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive_cluster(ptx::map_to_cta(&s.tile_empty[slot], 0));
    if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
    if (!(tile.flags & kValid)) break;

    // Mainloop: one wgmma group per K slice; keep one group in flight and release a stage as soon as
    // the group reading it has completed.
    uint32_t previous_stage = 0;
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbarrier_wait_bounded(&s.full[stage], phase, pipe_site, WaitTarget::kStageFull, stage);
      const uint32_t a_base = ptx::smem_addr(s.a[stage]) + consumer * kRowsPerConsumer * 128;
      const uint32_t b_base = ptx::smem_addr(s.b[stage]);
      ptx::fence_registers(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk)
        ptx::wgmma_m64n256k16_bf16(acc, ptx::wgmma_desc_k_major_sw128(a_base + kk * 32),
                                   ptx::wgmma_desc_k_major_sw128(b_base + kk * 32), kb > 0 || kk > 0);
      ptx::wgmma_commit_group();
      ptx::wgmma_wait_group<1>();
      ptx::fence_registers(acc);
      if (kb > 0 && lane == 0) release_stage(previous_stage);
      previous_stage = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(acc);
    if (lane == 0) release_stage(previous_stage);

    if (tile.flags & kStore) store_tile<kEpilogue>(acc, s, c_map, p, tile, consumer, thread);
  }
  if (thread == 0) ptx::bulk_wait_group<0>();  // stores must finish reading shared memory before exit
}

// ---- kernel -----------------------------------------------------------------------------------------

template <Epilogue kEpilogue>
__global__ void __cluster_dims__(kClusterSize, 1, 1) __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap b_half_map, const __grid_constant__ CUtensorMap c_map,
                        const KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s =
      *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t rank = ptx::cluster_ctarank();

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1);
      ptx::mbarrier_init(&s.empty[i], kStageReleases);
    }
    for (int i = 0; i < kTileSlots; ++i) {
      ptx::mbarrier_init(&s.tile_full[i], 1);
      ptx::mbarrier_init(&s.tile_empty[i], kTileReleases);
    }
    ptx::fence_mbarrier_init();
  }
  // Both CTAs' barriers exist before either CTA touches the other's.
  ptx::cluster_sync();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) run_producer(s, LoadMaps{&a_map, &b_map, &b_half_map}, p, rank);
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    run_consumer<kEpilogue>(s, &c_map, p, warpgroup - 1, rank);
  }
  // NOTES: neither CTA may exit while its peer can still arrive on its barriers or multicast into its
  // shared memory.
  ptx::cluster_sync();
}

// ---- host -------------------------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    POUNCE_REQUIRE(fn != nullptr && status == cudaDriverEntryPointSuccess,
                   "the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// Row-major bf16 [outer, inner] with boxes of [box_outer, box_inner], 128-byte swizzle, zero OOB fill.
CUtensorMap make_bf16_map(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner, uint32_t box_outer) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {inner * sizeof(__nv_bfloat16)};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult status = tensor_map_encoder()(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  POUNCE_REQUIRE(status == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", int(status), ") for a [", outer,
                 ", ", inner, "] bf16 tensor with box [", box_outer, ", ", box_inner, "]");
  return map;
}

// The most clusters that can be resident at once: a GPC whose free SM count is odd leaves one SM out,
// so this can be below multiprocessors / 2. A persistent grid must not exceed it.
template <Epilogue kEpilogue>
int resident_clusters() {
  static const int clusters = [] {
    CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kEpilogue>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSharedBytes)));
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(kClusterSize);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSharedBytes;
    int n = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, grouped_gemm_kernel<kEpilogue>, &config));
    POUNCE_REQUIRE(n > 0, "grouped GEMM: no cluster of ", kClusterSize, " CTAs with ", kSharedBytes,
                   " bytes of shared memory each fits on this GPU");
    return n;
  }();
  return clusters;
}

template <Epilogue kEpilogue>
void launch(const GroupedGemmArgs& args, const KernelParams& params, cudaStream_t stream) {
  const int clusters = std::min(resident_clusters<kEpilogue>(),
                                args.max_ctas > 0 ? std::max(1, args.max_ctas / kClusterSize) : INT32_MAX);
  const int ctas = clusters * kClusterSize;
  const int64_t out_cols = kEpilogue == Epilogue::kSwiGLU ? args.n / 2 : args.n;
  const CUtensorMap a_map = make_bf16_map(args.a, args.k, args.a_rows, kBlockK, kBlockM);
  const uint64_t b_rows = uint64_t(args.experts) * args.n;
  const CUtensorMap b_map = make_bf16_map(args.b, args.k, b_rows, kBlockK, kBlockN);
  const CUtensorMap b_half_map = make_bf16_map(args.b, args.k, b_rows, kBlockK, kBlockN / kClusterSize);
  const CUtensorMap c_map = make_bf16_map(args.c, out_cols, args.a_rows, kStoreBoxCols, kStoreBoxRows);
  grouped_gemm_kernel<kEpilogue><<<ctas, kThreads, kSharedBytes, stream>>>(a_map, b_map, b_half_map, c_map, params);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

int grouped_gemm_resident_ctas() { return resident_clusters<Epilogue::kStore>() * kClusterSize; }

GroupedGemm::GroupedGemm() : ticket_(1) {}

void GroupedGemm::run(const GroupedGemmArgs& args, cudaStream_t stream) {
  POUNCE_REQUIRE(args.experts >= 1, "grouped GEMM: experts = ", args.experts, ", must be at least 1");
  POUNCE_REQUIRE(args.n > 0 && args.n % 64 == 0, "grouped GEMM: n = ", args.n, " is not supported: it must be a positive multiple of 64");
  POUNCE_REQUIRE(args.k > 0 && args.k % 64 == 0, "grouped GEMM: k = ", args.k, " is not supported: it must be a positive multiple of 64");
  POUNCE_REQUIRE(args.a_rows >= 0 && args.a_rows % kBlockM == 0 && args.a_rows <= INT32_MAX, "grouped GEMM: a_rows = ",
                 args.a_rows, " must be a multiple of ", kBlockM, " that fits int32");
  POUNCE_REQUIRE(int64_t(args.experts) * args.n <= INT32_MAX && args.k <= INT32_MAX,
                 "grouped GEMM: experts * n = ", int64_t(args.experts) * args.n, " exceeds int32 row coordinates");
  POUNCE_REQUIRE(args.a && args.b && args.c && args.expert_offsets, "grouped GEMM: a, b, c and expert_offsets must be set");
  POUNCE_REQUIRE(args.tuning.band_pairs >= 1, "grouped GEMM: band_pairs = ", args.tuning.band_pairs,
                 ", must be at least 1");
  POUNCE_REQUIRE(gpu_is_hopper(), "grouped GEMM needs a Hopper GPU (sm_90a); this one is ",
                 gpu_info().present ? gpu_info().name : gpu_info().why_absent);
  if (args.a_rows == 0) return;

  KernelParams params{};
  params.experts = args.experts;
  params.n = int32_t(args.n);
  params.k = int32_t(args.k);
  params.a_rows = args.a_rows;
  params.expert_offsets = args.expert_offsets;
  params.row_scale = args.row_scale;
  params.m_block_ready = args.m_block_ready;
  params.ready_target = args.ready_target;
  params.multicast = args.tuning.multicast;
  params.band_pairs = args.tuning.band_pairs;
  params.ticket = ticket_.data();
  params.error = errors_.device_record();
  params.wait_timeout_ns = args.wait_timeout_ns;
  CUDA_CHECK(cudaMemsetAsync(ticket_.data(), 0, sizeof(uint32_t), stream));
  if (args.epilogue == Epilogue::kSwiGLU) launch<Epilogue::kSwiGLU>(args, params, stream);
  else launch<Epilogue::kStore>(args, params, stream);
}

}  // namespace pounce::gemm
