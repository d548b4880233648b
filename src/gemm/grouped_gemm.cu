// Stand-alone grouped GEMM kernel for sm_90a: the engine's CTA (gemm/gemm_pipeline.cuh) fed by the tile
// queue of one grouped GEMM, m-grouped (optionally gated by per-m-block readiness counters) or
// k-grouped.
#include <algorithm>

#include "common/bounded_wait.cuh"
#include "common/cuda_check.h"
#include "common/gpu.h"
#include "gemm/gemm_pipeline.cuh"
#include "gemm/grouped_gemm.h"
#include "gemm/tensor_map.h"
#include "gemm/tile_scheduler.cuh"
#include "ptx/ptx.cuh"

namespace pounce::gemm {
namespace {

using pipeline::GemmOperands;
using pipeline::kSharedBytesOf;
using pipeline::kThreads;
using pipeline::TileInfo;
using pipeline::TileKind;

struct KernelParams {
  int32_t experts;
  int32_t m, n, k;  // k-grouped: m and n of every expert's C (k comes from the schedule); m-grouped: n, k
  int64_t rows;     // of the row buffers: A (m-grouped), A and B (k-grouped)
  const int32_t* expert_offsets;
  const int32_t* expert_rows;  // optional
  const float* row_scale;
  const float* a_scale;  // FP8 only
  const float* b_scale;
  int32_t a_scale_stride, b_scale_stride;  // FP8 (GemmOperands): m-grouped a_rows; k-grouped m and n
  Epilogue epilogue;
  const uint32_t* m_block_ready;
  uint32_t ready_target;
  int32_t band_m_blocks;
  uint32_t* ticket;
  DeviceErrorSink error;
  uint64_t wait_timeout_ns;
  TimelineSink timeline;
};

// Tiles of one grouped GEMM from the shared ticket: m-grouped in TileScheduler order; k-grouped
// (kWeightGrad) expert by expert (its rows stay in L2 while its tiles run), n-blocks fastest.
template <TileKind kTileKind>
class QueueTiles {
 public:
  static constexpr TileKind kKind = kTileKind;
  static constexpr bool kKGrouped = kKind == TileKind::kWeightGrad || kKind == TileKind::kWeightGradFp8;
  static constexpr int kTileN = pipeline::StagesOf<kKind>::kTileN;
  static constexpr int kSliceK = pipeline::StagesOf<kKind>::kSliceK;

  __device__ QueueTiles(const KernelParams& p, const GemmOperands& op)
      : p_(p),
        op_(op),
        scheduler_{p.expert_offsets, p.experts, n_blocks(), p.band_m_blocks},
        ready_site_{p.error, DeviceRole::kGemmProducer, p.wait_timeout_ns} {
    // The rows in use come from device memory (the planner's output): check them before any load.
    const int32_t rows_in_use = p.expert_offsets[p.experts];
    total_tiles_ = kKGrouped ? int64_t(p.experts) * tiles_per_expert() : scheduler_.total_tiles();
    if (rows_in_use > p.rows) {
      report_device_error(p.error, DeviceErrorCode::kBadSchedule, DeviceRole::kGemmProducer, WaitTarget::kRowsInBounds,
                          p.experts, uint64_t(p.rows), uint64_t(rows_in_use), 0);
      total_tiles_ = 0;
    }
    // Offsets off the 128-row grid (m-blocks, K slices, E4M3 scale blocks) or going backwards would make
    // tiles silently drop or repeat rows: they stop the launch. The warp of the thread that calls next()
    // holds the only reader of total_tiles_; its lanes check offsets 32 apart.
    const auto off_grid = [&p](int32_t e) {
      const int32_t offset = p.expert_offsets[e];
      return offset % kBlockM != 0 || offset < (e > 0 ? p.expert_offsets[e - 1] : 0);
    };
    constexpr int kFetcherWarp = pipeline::kTileFetcherThread / 32;
    if (threadIdx.x / 32 == kFetcherWarp) {
      const int lane = threadIdx.x % 32;
      bool bad = false;
      for (int32_t e = lane; e <= p.experts; e += 32) bad |= off_grid(e);
      const uint32_t bad_lanes = __ballot_sync(0xFFFFFFFFu, bad);
      if (bad_lanes != 0) {
        if (lane == 0) {
          int32_t e = __ffs(bad_lanes) - 1;  // the first bad offset of the first lane that saw one
          while (!off_grid(e)) e += 32;
          report_device_error(p.error, DeviceErrorCode::kBadSchedule, DeviceRole::kGemmProducer,
                              WaitTarget::kOffsetsAligned, e, uint64_t(kBlockM), uint32_t(p.expert_offsets[e]), 0);
        }
        total_tiles_ = 0;
      }
    }
  }

  __device__ bool next(TileInfo& info) {
    const int64_t tile = atomicAdd(p_.ticket, 1u);
    if (tile >= total_tiles_) return false;
    if constexpr (kKGrouped) {
      const int32_t expert = int32_t(tile / tiles_per_expert()), in_expert = int32_t(tile % tiles_per_expert());
      const int32_t m_block = in_expert / n_blocks(), n_block = in_expert % n_blocks();
      const int32_t first_row = p_.expert_offsets[expert];
      // K slices past the expert's routed rows hold only padding: summing them adds zeros.
      int32_t k_rows = p_.expert_offsets[expert + 1] - first_row;
      if (p_.expert_rows != nullptr) k_rows = min(k_rows, max(0, p_.expert_rows[expert]));
      const int32_t k_blocks = (k_rows + kSliceK - 1) / kSliceK;
      // Row buffers read transposed (bf16: K rows, M or N columns) or stored transposed (E4M3: M or N rows,
      // K columns).
      constexpr bool kStoredTransposed = kKind == TileKind::kWeightGradFp8;
      const pipeline::OperandOrigin a = kStoredTransposed ? pipeline::OperandOrigin{m_block * kBlockM, first_row}
                                                          : pipeline::OperandOrigin{first_row, m_block * kBlockM};
      const pipeline::OperandOrigin b = kStoredTransposed ? pipeline::OperandOrigin{n_block * kTileN, first_row}
                                                          : pipeline::OperandOrigin{first_row, n_block * kTileN};
      info = {0, a, b, m_block * kBlockM, expert, n_block, m_block, k_blocks, 1, 0, kBlockM};
      return true;
    } else {
      return next_m_grouped(tile, info);
    }
  }

  __device__ const GemmOperands& operands(int) const { return op_; }
  __device__ const TimelineSink& timeline() const { return p_.timeline; }

 private:
  __device__ bool next_m_grouped(int64_t tile, TileInfo& info) {
    const TileCoord t = scheduler_.decode(tile);
    if (p_.m_block_ready != nullptr) {
      if (!counter_wait_bounded(p_.m_block_ready + t.m_block, p_.ready_target, ready_site_, WaitTarget::kMBlockReady,
                                t.m_block))
        return false;
      // NOTES: A rows were written by other CTAs through the generic proxy and acquired above; TMA reads
      // through the async proxy, which needs this fence to observe them.
      ptx::fence_proxy_async_global();
    }
    // B: K-major weights [experts * n, k] start at the expert's n-block row; N-major ones [experts * k, n]
    // at the expert's first K row and the n-block's column.
    const pipeline::OperandOrigin b = kKind != TileKind::kDataGrad
                                          ? pipeline::OperandOrigin{t.expert * p_.n + t.n_block * kTileN, 0}
                                          : pipeline::OperandOrigin{t.expert * p_.k, t.n_block * kTileN};
    // Rows of the tile that hold routes: all of them unless the expert's routed rows end inside it.
    int32_t rows = kBlockM;
    if (p_.expert_rows != nullptr)
      rows = min(kBlockM, max(0, p_.expert_offsets[t.expert] + p_.expert_rows[t.expert] - t.m_block * kBlockM));
    info = {0, {t.m_block * kBlockM, 0}, b, t.m_block * kBlockM, 0, t.n_block, t.m_block, p_.k / kSliceK, 1, 0, rows};
    return true;
  }

  __device__ int32_t n_blocks() const { return (p_.n + kTileN - 1) / kTileN; }
  __device__ int32_t tiles_per_expert() const { return ((p_.m + kBlockM - 1) / kBlockM) * n_blocks(); }

  const KernelParams& p_;
  const GemmOperands& op_;
  TileScheduler scheduler_;
  WaitSite ready_site_;
  int64_t total_tiles_ = 0;
};

template <TileKind kKind>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap c_map, const KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  const GemmOperands op{&a_map,  &b_map,    &c_map,    p.epilogue,       p.row_scale,     nullptr,
                        nullptr, p.a_scale, p.b_scale, p.a_scale_stride, p.b_scale_stride};
  QueueTiles<kKind> tiles(p, op);
  const WaitSite pipe_site{p.error, DeviceRole::kGemmProducer, pipeline::pipeline_timeout_ns(p.wait_timeout_ns)};
  pipeline::run_gemm_cta(smem_raw, tiles, pipe_site, [] {});
}

// ---- host -------------------------------------------------------------------------------------------

template <TileKind kKind>
void launch(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& c_map, const KernelParams& params,
            int max_ctas, cudaStream_t stream) {
  static const bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel<kKind>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    int(kSharedBytesOf<kKind>)));
    return true;
  }();
  (void)configured;
  const int ctas = max_ctas > 0 ? max_ctas : gpu_info().multiprocessors;
  grouped_gemm_kernel<kKind><<<ctas, kThreads, kSharedBytesOf<kKind>, stream>>>(a_map, b_map, c_map, params);
  CUDA_CHECK_LAUNCH();
}

void require_hopper() {
  POUNCE_REQUIRE(gpu_is_hopper(), "grouped GEMM needs a Hopper GPU (sm_90a); this one is ",
                 gpu_info().present ? gpu_info().name : gpu_info().why_absent);
}

void require_multiple_of_64(const char* what, int64_t value) {
  POUNCE_REQUIRE(value > 0 && value % 64 == 0 && value <= INT32_MAX, "grouped GEMM: ", what, " = ", value,
                 " is not supported: it must be a positive multiple of 64");
}

}  // namespace

GroupedGemm::GroupedGemm() : ticket_(1) {}

void GroupedGemm::run(const GroupedGemmArgs& args, cudaStream_t stream) {
  POUNCE_REQUIRE(args.experts >= 1, "grouped GEMM: experts = ", args.experts, ", must be at least 1");
  require_multiple_of_64("n", args.n);
  require_multiple_of_64("k", args.k);
  const bool fp8 = args.fp8.a != nullptr || args.fp8.b != nullptr;
  if (fp8) {
    POUNCE_REQUIRE(args.fp8.a && args.fp8.a_scale && args.fp8.b && args.fp8.b_scale && !args.a && !args.b,
                   "grouped GEMM: an FP8 GEMM needs fp8.a, fp8.a_scale, fp8.b and fp8.b_scale, and no bf16 a or b");
    POUNCE_REQUIRE(args.n % 128 == 0 && args.k % 128 == 0, "grouped GEMM: FP8 needs n and k in whole 128-blocks of ",
                   "its scales; n = ", args.n, ", k = ", args.k);
    POUNCE_REQUIRE(args.b_major == Major::kK, "grouped GEMM: FP8 weights must be K-major");
    POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(args.fp8.a_scale) % 16 == 0,
                   "grouped GEMM: fp8.a_scale must be 16-byte aligned (K block-major, [k / 128, a_rows])");
  }
  POUNCE_REQUIRE(args.a_rows >= 0 && args.a_rows % kBlockM == 0 && args.a_rows <= INT32_MAX,
                 "grouped GEMM: a_rows = ", args.a_rows, " must be a multiple of ", kBlockM, " that fits int32");
  POUNCE_REQUIRE(int64_t(args.experts) * std::max(args.n, args.k) <= INT32_MAX,
                 "grouped GEMM: experts * n = ", int64_t(args.experts) * args.n,
                 " or experts * k exceeds int32 row coordinates");
  POUNCE_REQUIRE((fp8 || (args.a && args.b)) && args.c && args.expert_offsets,
                 "grouped GEMM: a, b, c and expert_offsets must be set");
  POUNCE_REQUIRE(args.epilogue == Epilogue::kStore || (args.epilogue == Epilogue::kSwiGLU && args.b_major == Major::kK),
                 "grouped GEMM: an m-grouped GEMM writes bf16: kStore, or kSwiGLU with K-major weights");
  POUNCE_REQUIRE(args.tuning.band_m_blocks >= 1, "grouped GEMM: band_m_blocks = ", args.tuning.band_m_blocks,
                 ", must be at least 1");
  require_hopper();
  if (args.a_rows == 0) return;

  KernelParams params{};
  params.experts = args.experts;
  params.n = int32_t(args.n);
  params.k = int32_t(args.k);
  params.rows = args.a_rows;
  params.expert_offsets = args.expert_offsets;
  params.expert_rows = args.expert_rows;
  params.row_scale = args.row_scale;
  params.a_scale = args.fp8.a_scale;
  params.b_scale = args.fp8.b_scale;
  params.a_scale_stride = int32_t(args.a_rows);
  params.epilogue = args.epilogue;
  params.m_block_ready = args.m_block_ready;
  params.ready_target = args.ready_target;
  params.band_m_blocks = args.tuning.band_m_blocks;
  params.ticket = ticket_.data();
  params.error = errors_.device_sink();
  params.wait_timeout_ns = args.wait_timeout_ns;
  params.timeline = args.timeline;

  const uint64_t E = args.experts, n = args.n, k = args.k;
  const int64_t out_cols = args.epilogue == Epilogue::kSwiGLU ? args.n / 2 : args.n;
  const CUtensorMap c_map = make_bf16_tensor_map(args.c, out_cols, args.a_rows, kStoreBoxCols, kStoreBoxRows);
  CUDA_CHECK(cudaMemsetAsync(ticket_.data(), 0, sizeof(uint32_t), stream));
  if (fp8) {
    using Stages = pipeline::Fp8Stages;
    const CUtensorMap a_map = make_fp8_tensor_map(args.fp8.a, k, args.a_rows, Stages::kSliceK, kBlockM);
    const CUtensorMap b_map = make_fp8_tensor_map(args.fp8.b, k, E * n, Stages::kSliceK, Stages::kTileN);
    launch<TileKind::kForwardFp8>(a_map, b_map, c_map, params, args.max_ctas, stream);
    return;
  }
  const CUtensorMap a_map = make_bf16_tensor_map(args.a, k, args.a_rows, kBlockK, kBlockM);
  const CUtensorMap b_map = args.b_major == Major::kK ? make_bf16_tensor_map(args.b, k, E * n, kBlockK, kBlockN)
                                                      : make_bf16_tensor_map(args.b, n, E * k, 64, kBlockK);
  if (args.b_major == Major::kK)
    launch<TileKind::kForward>(a_map, b_map, c_map, params, args.max_ctas, stream);
  else
    launch<TileKind::kDataGrad>(a_map, b_map, c_map, params, args.max_ctas, stream);
}

void GroupedGemm::run_k_grouped(const KGroupedGemmArgs& args, cudaStream_t stream) {
  POUNCE_REQUIRE(args.experts >= 1, "k-grouped GEMM: experts = ", args.experts, ", must be at least 1");
  require_multiple_of_64("m", args.m);
  require_multiple_of_64("n", args.n);
  POUNCE_REQUIRE(args.m <= INT32_MAX && args.n <= INT32_MAX, "k-grouped GEMM: m = ", args.m, " and n = ", args.n,
                 " must fit int32");
  POUNCE_REQUIRE(args.rows >= 0 && args.rows % kBlockM == 0 && args.rows <= INT32_MAX,
                 "k-grouped GEMM: rows = ", args.rows, " must be a multiple of ", kBlockM, " that fits int32");
  const bool fp8 = args.fp8.a != nullptr || args.fp8.b != nullptr;
  if (fp8) {
    POUNCE_REQUIRE(args.fp8.a && args.fp8.a_scale && args.fp8.b && args.fp8.b_scale && !args.a && !args.b,
                   "k-grouped GEMM: an FP8 GEMM needs fp8.a, fp8.a_scale, fp8.b and fp8.b_scale, and no bf16 a or b");
    POUNCE_REQUIRE(args.m % 128 == 0 && args.n % 128 == 0,
                   "k-grouped GEMM: FP8 needs m and n in whole 128-blocks; m = ", args.m, ", n = ", args.n);
    POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(args.fp8.a_scale) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(args.fp8.b_scale) % 16 == 0,
                   "k-grouped GEMM: fp8.a_scale and fp8.b_scale must be 16-byte aligned");
  }
  POUNCE_REQUIRE((fp8 || (args.a && args.b)) && args.c && args.expert_offsets,
                 "k-grouped GEMM: a, b, c and expert_offsets must be set");
  POUNCE_REQUIRE(args.epilogue != Epilogue::kSwiGLU, "k-grouped GEMM: the SwiGLU epilogue is m-grouped only");
  require_hopper();

  KernelParams params{};
  params.experts = args.experts;
  params.m = int32_t(args.m);
  params.n = int32_t(args.n);
  params.rows = args.rows;
  params.expert_offsets = args.expert_offsets;
  params.expert_rows = args.expert_rows;
  params.epilogue = args.epilogue;
  params.band_m_blocks = 1;
  params.ticket = ticket_.data();
  params.error = errors_.device_sink();
  params.wait_timeout_ns = args.wait_timeout_ns;
  params.timeline = args.timeline;

  const bool fp32 = args.epilogue != Epilogue::kStore;
  const uint64_t rows = std::max<int64_t>(args.rows, kBlockM);  // a descriptor needs a nonzero extent
  const CUtensorMap c_map =
      make_3d_tensor_map(args.c, fp32, args.n, args.m, args.experts, fp32 ? 32 : kStoreBoxCols, kStoreBoxRows);
  CUDA_CHECK(cudaMemsetAsync(ticket_.data(), 0, sizeof(uint32_t), stream));
  if (fp8) {
    // Stored transposed: K-major boxes of 128 rows of M or N by one 128-wide K slice.
    params.a_scale = args.fp8.a_scale;
    params.b_scale = args.fp8.b_scale;
    params.a_scale_stride = int32_t(args.m);
    params.b_scale_stride = int32_t(args.n);
    const CUtensorMap a_map = make_fp8_tensor_map(args.fp8.a, rows, args.m, 128, kBlockM);
    const CUtensorMap b_map = make_fp8_tensor_map(args.fp8.b, rows, args.n, 128, 128);
    launch<TileKind::kWeightGradFp8>(a_map, b_map, c_map, params, args.max_ctas, stream);
    return;
  }
  // Both operands are row buffers read transposed: boxes of 64 columns by kBlockK rows.
  const CUtensorMap a_map = make_bf16_tensor_map(args.a, args.m, rows, 64, kBlockK);
  const CUtensorMap b_map = make_bf16_tensor_map(args.b, args.n, rows, 64, kBlockK);
  launch<TileKind::kWeightGrad>(a_map, b_map, c_map, params, args.max_ctas, stream);
}

}  // namespace pounce::gemm
