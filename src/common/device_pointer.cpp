#include "common/device_pointer.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "common/require.h"

namespace pounce {
namespace {

// cuMemGetAddressRange through the runtime's driver entry point: no link against libcuda.
PFN_cuMemGetAddressRange_v3020 address_range_query() {
  static PFN_cuMemGetAddressRange_v3020 query = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(fn);
  }();
  return query;
}

// require_device_memory's checks; `name()` spells what is checked and is called only for an error, so
// that the checks on every forward build no string.
template <class Name>
void check_device_memory(const void* ptr, int64_t bytes, int alignment, int device, const Name& name) {
  if (bytes <= 0) return;
  POUNCE_REQUIRE(ptr != nullptr, name(), " is a null pointer");
  POUNCE_REQUIRE(reinterpret_cast<uintptr_t>(ptr) % alignment == 0, name(), " at ", ptr, " is not ", alignment,
                 "-byte aligned");
  cudaPointerAttributes attributes{};
  const cudaError_t status = cudaPointerGetAttributes(&attributes, ptr);
  if (status != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so the caller's next check does not see it
    POUNCE_FAIL(name(), " at ", ptr, " is not a CUDA pointer (", cudaGetErrorString(status), ")");
  }
  POUNCE_REQUIRE(attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged, name(), " at ",
                 ptr, " is ", attributes.type == cudaMemoryTypeHost ? "pinned host memory" : "not CUDA memory",
                 ": it must be device memory of GPU ", device);
  POUNCE_REQUIRE(attributes.type == cudaMemoryTypeManaged || attributes.device == device, name(), " lives on GPU ",
                 attributes.device, ", not on GPU ", device);
  if (const auto query = address_range_query()) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (query(&base, &size, CUdeviceptr(reinterpret_cast<uintptr_t>(ptr))) == CUDA_SUCCESS) {
      const uint64_t available = base + size - reinterpret_cast<uintptr_t>(ptr);
      POUNCE_REQUIRE(available >= uint64_t(bytes), name(), " needs ", bytes, " bytes, but its allocation ends ",
                     available, " bytes after ", ptr);
    }
  }
}

}  // namespace

void require_device_memory(const void* ptr, int64_t bytes, int alignment, int device, const std::string& what) {
  check_device_memory(ptr, bytes, alignment, device, [&] { return what; });
}

void require_device_tensor(const void* ptr, int64_t bytes, int device, const char* tensor, int rank) {
  check_device_memory(ptr, bytes, 16, device, [&] { return "rank " + std::to_string(rank) + "'s " + tensor; });
}

}  // namespace pounce
