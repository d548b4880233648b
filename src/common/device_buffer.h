// Owning device allocation (cudaMalloc) with typed access; move-only. Plain allocations only: managed
// memory can hang a shared GPU when oversubscribed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/cuda_check.h"

namespace pounce {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  // A failed allocation throws naming its size, and clears the runtime's last error, which a later
  // launch check (cudaGetLastError) would otherwise report as its own failure.
  explicit DeviceBuffer(size_t count) {
    if (count == 0) return;
    POUNCE_REQUIRE(count <= SIZE_MAX / sizeof(T), "device allocation of ", count, " elements of ", sizeof(T),
                   " bytes overflows size_t");
    const size_t bytes = count * sizeof(T);
    if (const cudaError_t status = cudaMalloc(&data_, bytes); status != cudaSuccess) {
      data_ = nullptr;
      (void)cudaGetLastError();
      POUNCE_FAIL("device allocation of ", bytes, " bytes (", (bytes >> 30) + ((bytes & ((1ull << 30) - 1)) != 0),
                  " GiB rounded up) failed: ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")");
    }
    count_ = count;
  }
  explicit DeviceBuffer(std::span<const T> host) : DeviceBuffer(host.size()) { upload(host); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(std::span<const T>(host)) {}
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);  // no throw from a destructor; a failed free leaks, nothing worse
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(count_, other.count_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  size_t bytes() const { return count_ * sizeof(T); }

  void upload(std::span<const T> host) {
    POUNCE_REQUIRE(host.size() <= count_, "upload of ", host.size(), " elements into a buffer of ", count_);
    if (!host.empty()) CUDA_CHECK(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    if (count_ > 0) CUDA_CHECK(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte`: tests poison outputs this way before a kernel runs.
  void fill_bytes(int byte) {
    if (count_ > 0) CUDA_CHECK(cudaMemset(data_, byte, bytes()));
  }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

}  // namespace pounce
