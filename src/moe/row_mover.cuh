// Moves one item's rows with a whole communication CTA: thread 0 streams the first `engine_rows` rows
// through the bulk-copy engine while the other warps copy the rest with 16-byte loads and stores. The
// two paths run side by side: the engine is bound per piece (~0.36 us a row whatever its length, so it
// suits long rows), the warps by the SM's load/store throughput (~45 GB/s per CTA whatever the length;
// pounce_copy_bench measures both). Sources and destinations may be peer GPUs' NVLink addresses.
#pragma once

#include "moe/copy_engine.cuh"
#include "moe/fused_params.h"
#include "ptx/ptx.cuh"

namespace pounce::moe {

// Warps [first_warp, kThreads / 32) copy rows [0, rows) of the shared tables src/dst (src[r] == nullptr
// skips row r), a row per warp at a time, then fence their stores for readers that load with TMA. The
// caller's CTA barrier and release (or system-scope fence) follow.
template <int kThreads>
__device__ inline void copy_rows_by_warps(const void* const* src, void* const* dst, int rows, uint32_t row_bytes,
                                          int first_warp) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kInFlight = 8;  // 16-byte loads in flight per lane; more was no faster
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < first_warp) return;
  const uint32_t vecs = row_bytes / 16;
  for (int r = warp - first_warp; r < rows; r += kWarps - first_warp) {
    if (src[r] == nullptr) continue;
    const uint4* s = static_cast<const uint4*>(src[r]);
    uint4* d = static_cast<uint4*>(dst[r]);
    for (uint32_t v = lane; v < vecs; v += kInFlight * 32) {
      // Zero-initialized: a conditionally assigned element would carry the previous iteration's value
      // as far as the compiler knows, and those live ranges spilled.
      uint4 part[kInFlight] = {};
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (v + u * 32 < vecs) part[u] = s[v + u * 32];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (v + u * 32 < vecs) d[v + u * 32] = part[u];
    }
  }
  ptx::fence_proxy_async_global();  // our generic stores before the readers' TMA loads
}

// Called by every thread of the CTA. src[r] == nullptr skips row r. Returns after a CTA barrier, with
// every row landed and ordered for a release (or system-scope fence) that thread 0 issues next: the
// engine's bulk writes through flush(), the warps' stores through the barrier (a release is cumulative)
// and a proxy fence, since readers may load the rows with TMA.
template <int kThreads>
__device__ inline void move_rows(CopyEngine& engine, const void* const* src, void* const* dst, uint32_t row_bytes,
                                 int engine_rows) {
  if (threadIdx.x == 0) {
    for (int r = 0; r < engine_rows; ++r)
      if (src[r] != nullptr) engine.copy(src[r], dst[r], row_bytes);
  }
  // Warp 0 waits for its lane 0 while the engine runs, so the warps' rows go to warps 1.. then.
  copy_rows_by_warps<kThreads>(src + engine_rows, dst + engine_rows, kBlockM - engine_rows, row_bytes,
                               engine_rows > 0 ? 1 : 0);
  if (threadIdx.x == 0) engine.flush();
  __syncthreads();
}

}  // namespace pounce::moe
