// The device half of pounce_copy_bench (bench/copy_bench.cpp): how fast communication CTAs move rows
// (moe/row_mover.cuh). Every CTA takes items of 128 rows from a ticket, as the fused kernel's comm CTAs
// do, and copies each row from a random source row to its place in a contiguous destination.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "bench/timing.h"
#include "common/device_buffer.h"
#include "common/device_error.h"

namespace pounce::moe {

class RowCopyBench {
 public:
  // `sources` random source rows and `rows` destination rows, each at most max_row_bytes long.
  RowCopyBench(int64_t sources, int64_t rows, uint32_t max_row_bytes);
  ~RowCopyBench();
  RowCopyBench(const RowCopyBench&) = delete;
  RowCopyBench& operator=(const RowCopyBench&) = delete;

  // Times `ctas` CTAs copying the first `rows` rows, `row_bytes` each, the bulk-copy engine taking
  // engine_rows of every item; then checks every 997th destination row against its source (throws
  // pounce::Error).
  bench::Timing run(int64_t rows, uint32_t row_bytes, int ctas, int engine_rows, int warmup, int reps);

 private:
  uint32_t max_row_bytes_;
  std::vector<int32_t> src_row_;   // [rows] source row of each destination row
  std::vector<uint8_t> src_host_;  // [sources, max_row_bytes]
  DeviceBuffer<uint8_t> src_, dst_;
  DeviceBuffer<int32_t> d_src_row_;
  DeviceBuffer<uint32_t> ticket_;
  DeviceErrorSlot errors_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace pounce::moe
