// The benchmark's output checks: how far an implementation's output is from the reference's, row by
// row, computed on the GPU (a host comparison of every timed output would add minutes to a run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_buffer.h"

namespace pounce::bench {

struct OutputError {
  double relative_l2 = 0;  // ||got - want|| / ||want|| over every row compared
  double worst_row = 0;    // max over those rows of ||got_r - want_r|| / ||want_r||; NaN if any value is NaN
};

// One comparison of [rows, width] bf16 device buffers: enqueue() puts it on a stream, error() reads
// the result once that stream has been synchronized.
class RowComparison {
 public:
  explicit RowComparison(int64_t rows) : sums_(rows) {}
  // Rows whose row_token entry is negative (padding of an expert-contiguous pool) are skipped; a null
  // row_token compares every row.
  void enqueue(const __nv_bfloat16* got, const __nv_bfloat16* want, int64_t width, const int32_t* row_token,
               cudaStream_t stream);
  OutputError error() const;

 private:
  DeviceBuffer<double2> sums_;  // per row: sum of (got - want)^2, sum of want^2
};

}  // namespace pounce::bench
