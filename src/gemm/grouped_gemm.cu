// Stand-alone grouped GEMM kernel for sm_90a: the engine's CTA (gemm/gemm_pipeline.cuh) fed by the
// tile queue of one grouped GEMM, optionally gated by per-m-block readiness counters.
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
using pipeline::kSharedBytes;
using pipeline::kThreads;
using pipeline::TileInfo;

struct KernelParams {
  int32_t experts, n, k;
  int64_t a_rows;
  const int32_t* expert_offsets;
  const float* row_scale;
  Epilogue epilogue;
  const uint32_t* m_block_ready;
  uint32_t ready_target;
  int32_t band_m_blocks;
  uint32_t* ticket;
  DeviceErrorSink error;
  uint64_t wait_timeout_ns;
};

// Tiles of one grouped GEMM from the shared ticket, in TileScheduler order.
class QueueTiles {
 public:
  __device__ QueueTiles(const KernelParams& p, const GemmOperands& op)
      : p_(p),
        op_(op),
        scheduler_{p.expert_offsets, p.experts, p.n / kBlockN + (p.n % kBlockN != 0), p.band_m_blocks},
        ready_site_{p.error, DeviceRole::kGemmProducer, p.wait_timeout_ns} {
    // The rows in use come from device memory (the planner's output): check them before any load.
    const int32_t rows_in_use = p.expert_offsets[p.experts];
    total_tiles_ = scheduler_.total_tiles();
    if (rows_in_use > p.a_rows) {
      report_device_error(p.error, DeviceErrorCode::kBadSchedule, DeviceRole::kGemmProducer, WaitTarget::kRowsInBounds,
                          p.experts, uint64_t(p.a_rows), uint64_t(rows_in_use), 0);
      total_tiles_ = 0;
    }
  }

  __device__ bool next(TileInfo& info) {
    const int64_t tile = atomicAdd(p_.ticket, 1u);
    if (tile >= total_tiles_) return false;
    const TileCoord t = scheduler_.decode(tile);
    if (p_.m_block_ready != nullptr) {
      if (!counter_wait_bounded(p_.m_block_ready + t.m_block, p_.ready_target, ready_site_, WaitTarget::kMBlockReady,
                                t.m_block))
        return false;
      // NOTES: A rows were written by other CTAs through the generic proxy and acquired above; TMA reads
      // through the async proxy, which needs this fence to observe them.
      ptx::fence_proxy_async_global();
    }
    info = {0, t.expert * p_.n + t.n_block * kBlockN, t.m_block * kBlockM, t.n_block, t.m_block, 1};
    return true;
  }

  __device__ const GemmOperands& operands(int) const { return op_; }

 private:
  const KernelParams& p_;
  const GemmOperands& op_;
  TileScheduler scheduler_;
  WaitSite ready_site_;
  int64_t total_tiles_ = 0;
};

__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                        const __grid_constant__ CUtensorMap c_map, const KernelParams p) {
  extern __shared__ uint8_t smem_raw[];
  const GemmOperands op{&a_map, &b_map, &c_map, p.k / kBlockK, p.epilogue, p.row_scale, nullptr};
  QueueTiles tiles(p, op);
  const WaitSite pipe_site{p.error, DeviceRole::kGemmProducer, pipeline::pipeline_timeout_ns(p.wait_timeout_ns)};
  pipeline::run_gemm_cta(pipeline::shared_storage(smem_raw), tiles, pipe_site, [] {});
}

// ---- host -------------------------------------------------------------------------------------------

void launch(const GroupedGemmArgs& args, const KernelParams& params, int ctas, cudaStream_t stream) {
  static const bool configured = [] {
    CUDA_CHECK(
        cudaFuncSetAttribute(grouped_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes)));
    return true;
  }();
  (void)configured;
  const int64_t out_cols = args.epilogue == Epilogue::kSwiGLU ? args.n / 2 : args.n;
  const CUtensorMap a_map = make_bf16_tensor_map(args.a, args.k, args.a_rows, kBlockK, kBlockM);
  const CUtensorMap b_map = make_bf16_tensor_map(args.b, args.k, uint64_t(args.experts) * args.n, kBlockK, kBlockN);
  const CUtensorMap c_map = make_bf16_tensor_map(args.c, out_cols, args.a_rows, kStoreBoxCols, kStoreBoxRows);
  grouped_gemm_kernel<<<ctas, kThreads, kSharedBytes, stream>>>(a_map, b_map, c_map, params);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

GroupedGemm::GroupedGemm() : ticket_(1) {}

void GroupedGemm::run(const GroupedGemmArgs& args, cudaStream_t stream) {
  POUNCE_REQUIRE(args.experts >= 1, "grouped GEMM: experts = ", args.experts, ", must be at least 1");
  POUNCE_REQUIRE(args.n > 0 && args.n % 64 == 0, "grouped GEMM: n = ", args.n,
                 " is not supported: it must be a positive multiple of 64");
  POUNCE_REQUIRE(args.k > 0 && args.k % 64 == 0, "grouped GEMM: k = ", args.k,
                 " is not supported: it must be a positive multiple of 64");
  POUNCE_REQUIRE(args.a_rows >= 0 && args.a_rows % kBlockM == 0 && args.a_rows <= INT32_MAX,
                 "grouped GEMM: a_rows = ", args.a_rows, " must be a multiple of ", kBlockM, " that fits int32");
  POUNCE_REQUIRE(int64_t(args.experts) * args.n <= INT32_MAX && args.k <= INT32_MAX,
                 "grouped GEMM: experts * n = ", int64_t(args.experts) * args.n, " exceeds int32 row coordinates");
  POUNCE_REQUIRE(args.a && args.b && args.c && args.expert_offsets,
                 "grouped GEMM: a, b, c and expert_offsets must be set");
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
  params.epilogue = args.epilogue;
  params.m_block_ready = args.m_block_ready;
  params.ready_target = args.ready_target;
  params.band_m_blocks = args.tuning.band_m_blocks;
  params.ticket = ticket_.data();
  params.error = errors_.device_sink();
  params.wait_timeout_ns = args.wait_timeout_ns;
  const int ctas = args.max_ctas > 0 ? args.max_ctas : gpu_info().multiprocessors;
  CUDA_CHECK(cudaMemsetAsync(ticket_.data(), 0, sizeof(uint32_t), stream));
  launch(args, params, ctas, stream);
}

}  // namespace pounce::gemm
