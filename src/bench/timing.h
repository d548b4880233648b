// GPU timing with CUDA events: warm-up first, then one event pair per repetition, median reported.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "common/cuda_check.h"

namespace pounce::bench {

struct Timing {
  double median_ms = 0, p10_ms = 0, p90_ms = 0, min_ms = 0;
  int reps = 0;
};

// launch(rep) enqueues one run on `stream`; rep counts from 0 over warm-up and timed runs, so the
// caller can rotate input sets (rep % sets) to keep repeated runs from measuring the L2 cache.
template <typename Launch>
Timing time_on_stream(Launch&& launch, cudaStream_t stream, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) launch(i);
  std::vector<cudaEvent_t> events(2 * reps);
  for (auto& e : events) CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
    launch(warmup + i);
    CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> ms(reps);
  for (int i = 0; i < reps; ++i) {
    float elapsed = 0;
    CUDA_CHECK(cudaEventElapsedTime(&elapsed, events[2 * i], events[2 * i + 1]));
    ms[i] = elapsed;
  }
  for (auto& e : events) CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.reps = reps;
  t.median_ms = reps % 2 ? ms[reps / 2] : 0.5 * (ms[reps / 2 - 1] + ms[reps / 2]);
  t.p10_ms = ms[size_t(0.1 * (reps - 1))];
  t.p90_ms = ms[size_t(0.9 * (reps - 1) + 0.5)];
  t.min_ms = ms.front();
  return t;
}

}  // namespace pounce::bench
