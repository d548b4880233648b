// One host thread per GPU for work that spans GPUs in one process (multi-GPU tests and benchmarks).
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace pounce::comm {

// Runs a thread per GPU 0 .. gpus-1, each with its device current, in three phases:
//   prepare(rank)     rank-local set-up (allocations, uploads); may throw.
//   collective(rank)  work every rank must take part in (NCCL-collective construction, forwards); it
//                     runs only if every rank prepared. A throw is recorded and the rank waits for its
//                     own kernels to finish. Not contained: a rank that throws before an NCCL host
//                     collective its peers then enter (e.g. building its layer) leaves them waiting
//                     inside NCCL; kernel-side waits are bounded and end in errors.
//   finish(rank)      tear-down; runs once every rank has left `collective`, so no rank frees memory a
//                     peer may still read or write.
// Returns each rank's failure message ("" when it succeeded).
std::vector<std::string> run_on_every_gpu(int gpus, const std::function<void(int)>& prepare,
                                          const std::function<void(int)>& collective,
                                          const std::function<void(int)>& finish);

}  // namespace pounce::comm
