#include "common/device_buffer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>

#include "common/require.h"

namespace pounce {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// 2^50 floats (4 PiB) fail on any GPU, and without one: either way the error names the size, and the
// runtime's last error is left clear for the next launch check.
TEST(DeviceBuffer, FailedAllocationNamesItsSize) {
  EXPECT_THAT(
      [] { DeviceBuffer<float> buffer(size_t(1) << 50); },
      ThrowsMessage<Error>(HasSubstr("device allocation of 4503599627370496 bytes (4194304 GiB rounded up) failed")));
  int devices = 0;
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  }
}

TEST(DeviceBuffer, CountsPastSizeTAreRefusedByName) {
  EXPECT_THAT([] { DeviceBuffer<double> buffer(SIZE_MAX / 4); }, ThrowsMessage<Error>(HasSubstr("overflows size_t")));
}

TEST(DeviceBuffer, EmptyAllocatesNothing) {
  const DeviceBuffer<int> buffer(0);
  EXPECT_EQ(buffer.data(), nullptr);
  EXPECT_EQ(buffer.bytes(), 0u);
}

}  // namespace
}  // namespace pounce
