// Spin-waits with deadlines. Nothing in pounce waits forever: a wait that outlives its deadline writes
// a DeviceErrorRecord naming the counter, the expected and the observed value, and gives up.
#pragma once

#include <cstdint>

#include "common/device_error.h"
#include "ptx/ptx.cuh"

namespace pounce {

struct WaitSite {
  DeviceErrorSink sink;
  DeviceRole role;
  uint64_t timeout_ns;
  int32_t rank = 0;  // reported with the error
};

// Scope of a counter's acquire: counters written only by this GPU use kGpu; counters other GPUs write
// (combine arrivals, start flags) use kSystem.
enum class Scope { kGpu, kSystem };

// Waits for an mbarrier phase. These waits are inside one CTA: if one stalls past its deadline the CTA's
// pipeline is broken (a TMA fault, a bug) and no other CTA can unblock it. It reports and gives up, and so
// does every later wait of the launch that finds an error reported: the kernel runs to its end with
// garbage in its outputs, and the host raises the error (the context stays usable; nothing is left
// waiting).
// NOTES: no __trap() here: with a trap path in the kernel, ptxas allocated every role's registers within
// the launch-bounds limit (168 of 384 threads' share), ignoring the consumers' larger setmaxnreg budget.
__device__ __forceinline__ void mbarrier_wait_bounded(uint64_t* bar, uint32_t parity, const WaitSite& site,
                                                      WaitTarget target, int index) {
  if (ptx::mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = ptx::globaltimer_ns();
  // No sleeping between polls: try_wait already suspends the thread until the phase completes or a
  // hardware time limit passes, and a sleep on top of it woke the FP8 GEMM's consumers late (2-5 %).
  // The clock is read only now and then.
  for (uint32_t spins = 1; !ptx::mbarrier_try_wait(bar, parity); ++spins) {
    if (spins % 64 != 0) continue;
    if (device_error_reported(site.sink)) return;
    const uint64_t waited = ptx::globaltimer_ns() - start;
    if (waited > site.timeout_ns) {
      report_device_error(site.sink, DeviceErrorCode::kWaitTimeout, site.role, target, index, parity, parity ^ 1,
                          waited, site.rank);
      return;
    }
  }
}

// Waits until *counter >= target (wrap-safe), then acquires at the counter's scope. Returns false,
// having reported, when the deadline passes; also returns false early once another CTA has reported an
// error, so one failure stops the whole kernel instead of every waiter timing out in turn.
// NOTES: polls with relaxed loads and acquires once with a fence (the acquire pattern): an ld.acquire
// per poll would invalidate the SM's L1 on every iteration, slowing every other warp on the SM.
template <Scope kScope = Scope::kGpu>
__device__ __forceinline__ bool counter_wait_bounded(const uint32_t* counter, uint32_t target, const WaitSite& site,
                                                     WaitTarget what, int64_t index, uint32_t max_backoff_ns = 2048) {
  const auto load = [counter] {
    return kScope == Scope::kGpu ? ptx::ld_relaxed_gpu(counter) : ptx::ld_relaxed_sys(counter);
  };
  const auto acquire = [] {
    if constexpr (kScope == Scope::kGpu)
      ptx::fence_acq_rel_gpu();
    else
      ptx::fence_acq_rel_sys();
  };
  uint32_t seen = load();
  if (int32_t(seen - target) >= 0) return acquire(), true;
  const uint64_t start = ptx::globaltimer_ns();
  uint32_t backoff_ns = 32;
  for (uint32_t spins = 1;; ++spins) {
    // Exponential backoff: up to ~130 CTAs may wait on the same counter. Waits that sit on the critical
    // path of every CTA (the planning barriers) cap it lower: each overshoots by up to the last sleep.
    __nanosleep(backoff_ns);
    if (backoff_ns < max_backoff_ns) backoff_ns *= 2;
    seen = load();
    if (int32_t(seen - target) >= 0) return acquire(), true;
    if (spins % 64 == 0) {
      const uint64_t waited = ptx::globaltimer_ns() - start;
      if (waited > site.timeout_ns) {
        report_device_error(site.sink, DeviceErrorCode::kWaitTimeout, site.role, what, index, target, seen, waited,
                            site.rank);
        return false;
      }
      if (device_error_reported(site.sink)) return false;
    }
  }
}

}  // namespace pounce
