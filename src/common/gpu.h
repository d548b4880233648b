// Which GPU (if any) this process can use. Tests call POUNCE_REQUIRE_HOPPER() first: on a machine
// without a Hopper GPU they skip (GTEST_SKIP) instead of failing, so the CPU-only CI stays green while
// saying nothing about GPU correctness.
#pragma once

#include <cstdint>
#include <string>

namespace pounce {

struct GpuInfo {
  bool present = false;  // a CUDA device could be opened
  std::string name;      // "NVIDIA H200"
  int sm_major = 0, sm_minor = 0;
  int multiprocessors = 0;
  int64_t global_memory_bytes = 0;
  int l2_bytes = 0;
  std::string why_absent;  // set when !present: the CUDA error, or "no CUDA device"
};

// Device 0 as seen by the CUDA runtime; cached after the first call.
const GpuInfo& gpu_info();

// True for compute capability 9.0 (the sm_90a kernels run only there).
inline bool gpu_is_hopper() { return gpu_info().present && gpu_info().sm_major == 9 && gpu_info().sm_minor == 0; }

}  // namespace pounce

#define POUNCE_REQUIRE_HOPPER()                                                                                     \
  do {                                                                                                              \
    if (!::pounce::gpu_is_hopper())                                                                                 \
      GTEST_SKIP() << "needs a Hopper GPU (sm_90): "                                                                \
                   << (::pounce::gpu_info().present ? ::pounce::gpu_info().name : ::pounce::gpu_info().why_absent); \
  } while (0)
