// Checks on the device pointers a caller hands to pounce: a wrong pointer gives an error that names the
// tensor instead of a kernel fault that loses the CUDA context.
#pragma once

#include <cstdint>
#include <string>

namespace pounce {

// Throws pounce::Error naming `what` when `ptr` is null, is not `alignment`-byte aligned, is not device
// memory of GPU `device`, or ends its allocation fewer than `bytes` bytes after `ptr` (where the driver
// can tell). bytes = 0 checks nothing.
void require_device_memory(const void* ptr, int64_t bytes, int alignment, int device, const std::string& what);

// require_device_memory for a layer's tensor, named "rank <rank>'s <tensor>": 16-byte aligned (TMA and
// the 16-byte vector accesses need it).
void require_device_tensor(const void* ptr, int64_t bytes, int device, const char* tensor, int rank);

}  // namespace pounce
