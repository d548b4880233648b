// Spin-waits with deadlines. Nothing in pounce waits forever: a wait that outlives its deadline writes
// a DeviceErrorRecord naming the counter, the expected and the observed value, and gives up.
#pragma once

#include <cstdint>

#include "common/device_error.h"
#include "ptx/ptx.cuh"

namespace pounce {

struct WaitSite {
  DeviceErrorRecord* record;
  DeviceRole role;
  uint64_t timeout_ns;
  int32_t rank = 0;  // reported with the error
};

// Scope of a counter's acquire: counters written only by this GPU use kGpu; counters other GPUs write
// (combine arrivals, start flags) use kSystem.
enum class Scope { kGpu, kSystem };

// Waits for an mbarrier phase. These waits are inside one CTA: if one stalls past its deadline the CTA's
// pipeline is broken (a TMA fault, a bug), no other CTA can unblock it, so after reporting it traps.
__device__ __forceinline__ void mbarrier_wait_bounded(uint64_t* bar, uint32_t parity, const WaitSite& site,
                                                      WaitTarget target, int index) {
  if (ptx::mbarrier_try_wait(bar, parity)) return;
  const uint64_t start = ptx::globaltimer_ns();
  while (!ptx::mbarrier_try_wait(bar, parity)) {
    const uint64_t waited = ptx::globaltimer_ns() - start;
    if (waited > site.timeout_ns) {
      report_device_error(site.record, DeviceErrorCode::kWaitTimeout, site.role, target, index, parity, parity ^ 1,
                          waited, site.rank);
      __trap();
    }
  }
}

// Waits until *counter >= target (wrap-safe, acquire at GPU scope). Returns false, having reported,
// when the deadline passes; also returns false early once another CTA has reported an error, so one
// failure stops the whole kernel instead of every waiter timing out in turn.
template <Scope kScope = Scope::kGpu>
__device__ __forceinline__ bool counter_wait_bounded(const uint32_t* counter, uint32_t target, const WaitSite& site,
                                                     WaitTarget what, int64_t index) {
  const auto load = [counter] {
    return kScope == Scope::kGpu ? ptx::ld_acquire_gpu(counter) : ptx::ld_acquire_sys(counter);
  };
  uint32_t seen = load();
  if (int32_t(seen - target) >= 0) return true;
  const uint64_t start = ptx::globaltimer_ns();
  for (uint32_t spins = 1;; ++spins) {
    seen = load();
    if (int32_t(seen - target) >= 0) return true;
    if (spins % 256 == 0) {
      const uint64_t waited = ptx::globaltimer_ns() - start;
      if (waited > site.timeout_ns) {
        report_device_error(site.record, DeviceErrorCode::kWaitTimeout, site.role, what, index, target, seen, waited,
                            site.rank);
        return false;
      }
      if (site.record && *reinterpret_cast<volatile uint32_t*>(&site.record->claimed) != 0) return false;
    }
    __nanosleep(64);
  }
}

}  // namespace pounce
