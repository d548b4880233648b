// GPU timing with CUDA events: warm-up first, then one event pair per repetition, median reported.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "common/cuda_check.h"

namespace pounce::bench {

struct Timing {
  double median_ms = 0, p10_ms = 0, p90_ms = 0, min_ms = 0;
  int reps = 0;
};

inline Timing summarize(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  Timing t;
  t.reps = int(n);
  t.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  t.p10_ms = ms[size_t(0.1 * double(n - 1))];
  t.p90_ms = ms[size_t(0.9 * double(n - 1) + 0.5)];
  t.min_ms = ms.front();
  return t;
}

// Times several implementations of one step. Repetitions are interleaved (rep 0 of every candidate,
// then rep 1, ...) so that clock and temperature drift under sustained load affects all of them alike
// instead of penalising whichever runs last. Each repetition runs the candidates in a fresh (seeded)
// shuffled order: at the power cap a run's clocks depend on what ran just before it (a low-power
// predecessor leaves headroom), and a fixed order would hand every candidate the same predecessor.
// launch(rep) enqueues one run on `stream`; rep counts over warm-up and timed runs, so callers can
// rotate input sets (rep % sets) to keep out of the L2 cache. before_last(c) and after_last(c), when
// given, enqueue work around candidate c's last timed run, outside its events: the benchmark poisons
// c's output before it and checks that output after it, so what it checks is a timed run's.
template <typename Launch>
std::vector<Timing> time_interleaved(const std::vector<Launch>& launches, cudaStream_t stream, int warmup, int reps,
                                     const std::function<void(size_t)>& before_last = {},
                                     const std::function<void(size_t)>& after_last = {}) {
  for (int i = 0; i < warmup; ++i)
    for (const Launch& launch : launches) launch(i);
  const size_t n = launches.size();
  std::vector<cudaEvent_t> events(2 * n * reps);
  for (auto& e : events) CUDA_CHECK(cudaEventCreate(&e));
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::mt19937 shuffle_rng(2026);
  for (int i = 0; i < reps; ++i) {
    std::shuffle(order.begin(), order.end(), shuffle_rng);
    const bool last = i == reps - 1;
    for (const size_t c : order) {
      if (last && before_last) before_last(c);
      CUDA_CHECK(cudaEventRecord(events[2 * (i * n + c)], stream));
      launches[c](warmup + i);
      CUDA_CHECK(cudaEventRecord(events[2 * (i * n + c) + 1], stream));
      if (last && after_last) after_last(c);
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<Timing> timings;
  for (size_t c = 0; c < n; ++c) {
    std::vector<double> ms(reps);
    for (int i = 0; i < reps; ++i) {
      float elapsed = 0;
      CUDA_CHECK(cudaEventElapsedTime(&elapsed, events[2 * (i * n + c)], events[2 * (i * n + c) + 1]));
      ms[i] = elapsed;
    }
    timings.push_back(summarize(std::move(ms)));
  }
  for (auto& e : events) CUDA_CHECK(cudaEventDestroy(e));
  return timings;
}

template <typename Launch>
Timing time_on_stream(const Launch& launch, cudaStream_t stream, int warmup, int reps) {
  return time_interleaved(std::vector<Launch>{launch}, stream, warmup, reps).front();
}

}  // namespace pounce::bench
