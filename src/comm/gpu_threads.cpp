#include "comm/gpu_threads.h"

#include <cuda_runtime.h>

#include <barrier>
#include <exception>
#include <thread>

#include "common/cuda_check.h"

namespace pounce::comm {

std::vector<std::string> run_on_every_gpu(int gpus, const std::function<void(int)>& prepare,
                                          const std::function<void(int)>& collective,
                                          const std::function<void(int)>& finish) {
  std::vector<std::string> failures(gpus);
  std::barrier sync(gpus);
  auto any_failed = [&] {
    for (const std::string& f : failures)
      if (!f.empty()) return true;
    return false;
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < gpus; ++rank)
    threads.emplace_back([&, rank] {
      try {
        CUDA_CHECK(cudaSetDevice(rank));
        prepare(rank);
      } catch (const std::exception& e) {
        failures[rank] = e.what();
      }
      sync.arrive_and_wait();  // every rank starts the collective phase, or none does
      if (!any_failed()) {
        try {
          collective(rank);
        } catch (const std::exception& e) {
          failures[rank] = e.what();
          cudaDeviceSynchronize();  // this rank's kernels are done before anything of it is freed
        }
      }
      sync.arrive_and_wait();
      try {
        finish(rank);
      } catch (const std::exception& e) {
        if (failures[rank].empty()) failures[rank] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  return failures;
}

}  // namespace pounce::comm
