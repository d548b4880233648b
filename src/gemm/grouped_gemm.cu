// Grouped GEMM kernel for sm_90a. Sections in fixed order: configuration and shared-memory layout,
// producer role, consumer role (mainloop, epilogue), kernel entry, host launcher.
//
// One CTA per SM, 384 threads:
//   warpgroup 0: producer. One thread takes tiles from the queue, waits for the m-block's readiness,
//                publishes the tile to the consumers and streams A/B K-slices with TMA into a
//                kStages-deep mbarrier ring.
//   warpgroups 1-2: consumers. Each owns 64 of the tile's 128 rows: wgmma m64n256k16 from shared memory,
//                fp32 accumulators in registers, then the epilogue (SwiGLU, row scale) writes bf16 into
//                a swizzled staging box that a TMA store copies out while the next tile's mainloop runs.
#include "gemm/grouped_gemm.h"

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common/bounded_wait.cuh"
#include "common/cuda_check.h"
#include "common/gpu.h"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ptx.cuh"

namespace pounce::gemm {
namespace {

// ---- configuration and shared memory ---------------------------------------------------------------

constexpr int kStages = 4;
constexpr int kConsumerWarpgroups = 2;
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kRowsPerConsumer = kBlockM / kConsumerWarpgroups;  // 64: one wgmma M
constexpr int kStoreBoxCols = 64;  // a TMA store box is 64 bf16 (128 bytes, one swizzle row) wide...
constexpr int kStoreBoxRows = kRowsPerConsumer;  // ...and one consumer's rows high
constexpr int kStoreSlots = 2;     // per consumer: fill one box while the previous one is stored
constexpr int kTileSlots = 2;      // the producer may run one tile ahead of the consumers
constexpr uint32_t kStageBytes = (kBlockM + kBlockN) * kBlockK * sizeof(__nv_bfloat16);
// setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536 registers.
constexpr uint32_t kProducerRegisters = 40;
constexpr uint32_t kConsumerRegisters = 232;

// Hardware named barriers; 0 is __syncthreads. One per consumer warpgroup for its epilogue.
enum NamedBarrier : uint32_t { kEpilogueBarrierBase = 1 };

struct TileInfo {
  int32_t expert, m_block, n_block;
  int32_t valid;  // 0: no more tiles (queue drained, or the producer gave up): consumers exit
};

// Every TMA tile starts on a 1024-byte boundary: the 128-byte swizzle pattern repeats every 8 rows
// of 128 bytes and is computed from absolute shared-memory address bits.
struct SharedStorage {
  alignas(1024) __nv_bfloat16 a[kStages][kBlockM * kBlockK];
  alignas(1024) __nv_bfloat16 b[kStages][kBlockN * kBlockK];
  alignas(1024) __nv_bfloat16 c[kConsumerWarpgroups][kStoreSlots][kStoreBoxRows * kStoreBoxCols];
  uint64_t full[kStages];   // TMA bytes landed          (1 producer arrival + transaction bytes)
  uint64_t empty[kStages];  // consumers done reading    (one arrival per consumer warp)
  uint64_t tile_full[kTileSlots];
  uint64_t tile_empty[kTileSlots];
  TileInfo tiles[kTileSlots];
};
constexpr size_t kSharedBytes = sizeof(SharedStorage) + 1024;  // + slack to align the dynamic base
static_assert(kSharedBytes <= 232448, "shared memory exceeds the sm_90 per-block limit");
static_assert(kBlockK * sizeof(__nv_bfloat16) == 128, "one K slice row must be one 128-byte swizzle row");

constexpr uint32_t kConsumerWarps = kConsumerWarpgroups * 4;

struct KernelParams {
  int32_t experts, n, k;
  int64_t a_rows;
  const int32_t* expert_offsets;
  const float* row_scale;
  const uint32_t* m_block_ready;
  uint32_t ready_target;
  int32_t band_m_blocks;
  uint32_t* ticket;
  DeviceErrorRecord* error;
  uint64_t wait_timeout_ns;
};

// Waits inside the CTA must outlast the producer's readiness wait, which they may sit behind.
__device__ __forceinline__ uint64_t pipeline_timeout_ns(const KernelParams& p) {
  return 2 * p.wait_timeout_ns + 1'000'000'000ull;
}

// ---- producer ---------------------------------------------------------------------------------------

__device__ void run_producer(SharedStorage& s, const CUtensorMap* a_map, const CUtensorMap* b_map,
                             const KernelParams& p) {
  ptx::prefetch_tensormap(a_map);
  ptx::prefetch_tensormap(b_map);
  const WaitSite ready_site{p.error, DeviceRole::kGemmProducer, p.wait_timeout_ns};
  const WaitSite pipe_site{p.error, DeviceRole::kGemmProducer, pipeline_timeout_ns(p)};
  const TileScheduler scheduler{p.expert_offsets, p.experts, p.n / kBlockN + (p.n % kBlockN != 0), p.band_m_blocks};

  // The rows in use come from device memory (the planner's output): check them before any load.
  const int32_t rows_in_use = p.expert_offsets[p.experts];
  int64_t total_tiles = scheduler.total_tiles();
  if (rows_in_use > p.a_rows) {
    report_device_error(p.error, DeviceErrorCode::kBadSchedule, DeviceRole::kGemmProducer,
                        WaitTarget::kRowsInBounds, p.experts, uint64_t(p.a_rows), uint64_t(rows_in_use), 0);
    total_tiles = 0;
  }

  const int k_blocks = p.k / kBlockK;
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0;
  for (;;) {
    TileInfo info{0, 0, 0, 0};
    const int64_t tile = atomicAdd(p.ticket, 1u);
    if (tile < total_tiles) {
      const TileCoord t = scheduler.decode(tile);
      const bool ready = p.m_block_ready == nullptr ||
                         counter_wait_bounded(p.m_block_ready + t.m_block, p.ready_target, ready_site,
                                              WaitTarget::kMBlockReady, t.m_block);
      if (ready) info = {t.expert, t.m_block, t.n_block, 1};
    }
    mbarrier_wait_bounded(&s.tile_empty[slot], slot_phase ^ 1, pipe_site, WaitTarget::kTileInfoFree, slot);
    s.tiles[slot] = info;
    ptx::mbarrier_arrive(&s.tile_full[slot]);  // release: the consumers' wait makes `info` visible
    if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
    if (!info.valid) return;

    // NOTES: A rows were written by other CTAs through the generic proxy and acquired above; TMA reads
    // through the async proxy, which needs this fence to observe them.
    if (p.m_block_ready != nullptr) ptx::fence_proxy_async_global();
    const int32_t a_row = info.m_block * kBlockM;
    const int32_t b_row = info.expert * p.n + info.n_block * kBlockN;
    for (int kb = 0; kb < k_blocks; ++kb) {
      mbarrier_wait_bounded(&s.empty[stage], phase ^ 1, pipe_site, WaitTarget::kStageEmpty, stage);
      ptx::mbarrier_arrive_expect_tx(&s.full[stage], kStageBytes);
      ptx::tma_load_2d(s.a[stage], a_map, &s.full[stage], kb * kBlockK, a_row);
      // B rows past the last expert are out of bounds and zero-filled; rows past this expert's N belong
      // to the next expert and only feed output columns the clipped store never writes.
      ptx::tma_load_2d(s.b[stage], b_map, &s.full[stage], kb * kBlockK, b_row);
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  }
}

// ---- consumer ---------------------------------------------------------------------------------------

// NOTES: silu(g) = g * sigmoid(g) with sigmoid(g) = 0.5 + 0.5 * tanh(g / 2): four instructions, one of
// them MUFU. The epilogue stalls the tensor cores while it runs, and the exp-and-divide form cost ~7%
// of GEMM1's time (measured: docs/grouped_gemm.md).
__device__ __forceinline__ float silu(float g) { return g * fmaf(0.5f, ptx::tanh_approx(0.5f * g), 0.5f); }

__device__ __forceinline__ void st_shared_bf16x2(uint32_t addr, float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  ptx::st_shared_b32(addr, *reinterpret_cast<const uint32_t*>(&v));
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
__device__ void run_consumer(SharedStorage& s, const CUtensorMap* c_map, const KernelParams& p, int consumer) {
  const int thread = threadIdx.x % 128, lane = thread % 32;
  const WaitSite pipe_site{p.error, DeviceRole::kGemmConsumer, pipeline_timeout_ns(p)};
  const int k_blocks = p.k / kBlockK;
  float acc[128];
  uint32_t stage = 0, phase = 0, slot = 0, slot_phase = 0;
  for (;;) {
    mbarrier_wait_bounded(&s.tile_full[slot], slot_phase, pipe_site, WaitTarget::kTileInfo, slot);
    const TileInfo tile = s.tiles[slot];
    __syncwarp();
    if (lane == 0) ptx::mbarrier_arrive(&s.tile_empty[slot]);
    if (++slot == kTileSlots) slot = 0, slot_phase ^= 1;
    if (!tile.valid) break;

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
      if (kb > 0 && lane == 0) ptx::mbarrier_arrive(&s.empty[previous_stage]);
      previous_stage = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    ptx::wgmma_wait_group<0>();
    ptx::fence_registers(acc);
    if (lane == 0) ptx::mbarrier_arrive(&s.empty[previous_stage]);

    store_tile<kEpilogue>(acc, s, c_map, p, tile, consumer, thread);
  }
  if (thread == 0) ptx::bulk_wait_group<0>();  // stores must finish reading shared memory before exit
}

// ---- kernel -----------------------------------------------------------------------------------------

template <Epilogue kEpilogue>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap c_map, const KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  SharedStorage& s =
      *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      ptx::mbarrier_init(&s.full[i], 1);
      ptx::mbarrier_init(&s.empty[i], kConsumerWarps);
    }
    for (int i = 0; i < kTileSlots; ++i) {
      ptx::mbarrier_init(&s.tile_full[i], 1);
      ptx::mbarrier_init(&s.tile_empty[i], kConsumerWarps);
    }
    ptx::fence_mbarrier_init();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) run_producer(s, &a_map, &b_map, p);
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    run_consumer<kEpilogue>(s, &c_map, p, warpgroup - 1);
  }
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

template <Epilogue kEpilogue>
void launch(const GroupedGemmArgs& args, const KernelParams& params, int ctas, cudaStream_t stream) {
  static const bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kEpilogue>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSharedBytes)));
    return true;
  }();
  (void)configured;
  const int64_t out_cols = kEpilogue == Epilogue::kSwiGLU ? args.n / 2 : args.n;
  const CUtensorMap a_map = make_bf16_map(args.a, args.k, args.a_rows, kBlockK, kBlockM);
  const CUtensorMap b_map = make_bf16_map(args.b, args.k, uint64_t(args.experts) * args.n, kBlockK, kBlockN);
  const CUtensorMap c_map = make_bf16_map(args.c, out_cols, args.a_rows, kStoreBoxCols, kStoreBoxRows);
  grouped_gemm_kernel<kEpilogue><<<ctas, kThreads, kSharedBytes, stream>>>(a_map, b_map, c_map, params);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

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
  POUNCE_REQUIRE(args.tuning.band_m_blocks >= 1, "grouped GEMM: band_m_blocks = ", args.tuning.band_m_blocks,
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
  params.band_m_blocks = args.tuning.band_m_blocks;
  params.ticket = ticket_.data();
  params.error = errors_.device_record();
  params.wait_timeout_ns = args.wait_timeout_ns;
  const int ctas = args.max_ctas > 0 ? args.max_ctas : gpu_info().multiprocessors;
  CUDA_CHECK(cudaMemsetAsync(ticket_.data(), 0, sizeof(uint32_t), stream));
  if (args.epilogue == Epilogue::kSwiGLU) launch<Epilogue::kSwiGLU>(args, params, ctas, stream);
  else launch<Epilogue::kStore>(args, params, ctas, stream);
}

}  // namespace pounce::gemm
