#include "common/device_error.h"

#include <cstring>
#include <sstream>

#include "common/cuda_check.h"

namespace pounce {

DeviceErrorSlot::DeviceErrorSlot() {
  // Portable: one process may drive several GPUs, each with its own layers and records.
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(DeviceErrorRecord),
                           cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host_, 0, sizeof(DeviceErrorRecord));
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
  CUDA_CHECK(cudaMalloc(&reported_, sizeof(uint32_t)));
  CUDA_CHECK(cudaMemset(reported_, 0, sizeof(uint32_t)));
}

DeviceErrorSlot::~DeviceErrorSlot() {
  if (host_) cudaFreeHost(host_);
  if (reported_) cudaFree(reported_);
}

bool DeviceErrorSlot::has_error() const { return *reinterpret_cast<volatile uint32_t*>(&host_->code) != 0; }

static const char* role_name(uint32_t role) {
  switch (DeviceRole(role)) {
    case DeviceRole::kGemmProducer:
      return "gemm producer";
    case DeviceRole::kGemmConsumer:
      return "gemm consumer";
    case DeviceRole::kPlanner:
      return "planner";
    case DeviceRole::kDispatch:
      return "dispatch";
    case DeviceRole::kCombine:
      return "combine";
    case DeviceRole::kWeightedSum:
      return "weighted sum";
    case DeviceRole::kRankSync:
      return "rank sync";
    case DeviceRole::kTileGate:
      return "tile gate";
    case DeviceRole::kBackward:
      return "backward";
  }
  return "unknown role";
}

// What a user should check when a wait gave up, in their words; the counter details follow it.
static std::string likely_cause(const DeviceErrorRecord& r) {
  std::ostringstream out;
  switch (WaitTarget(r.target)) {
    case WaitTarget::kStartFlag:
      out << "rank " << r.index << " never started this forward: check that every rank calls forward() once per "
          << "step, on layers built with the same config, and that no rank has exited or failed";
      break;
    case WaitTarget::kTokenArrivals:
      out << "rank " << r.rank << " waited for the expert outputs of its token " << r.index
          << ", which never all came back: a rank holding one of its experts stalled or failed in this forward";
      break;
    case WaitTarget::kTokensQuantized:
      out << "rank " << r.index << " never quantized its tokens for this forward: one of its CTAs stalled or "
          << "failed";
      break;
    case WaitTarget::kMBlockReady:
      out << "rank " << r.rank << "'s experts waited for token rows that never arrived: a source rank, or this "
          << "rank's communication CTAs, stalled or failed in this forward";
      break;
    case WaitTarget::kRingSlotFree:
    case WaitTarget::kGemm1Done:
    case WaitTarget::kGemm2Done:
    case WaitTarget::kSwigluDone:
    case WaitTarget::kHiddenQuantized:
    case WaitTarget::kWgradInputs:
      out << "rank " << r.rank << "'s pipeline stopped: token rows it waits for never arrived (a source rank, or "
          << "this rank's communication CTAs, stalled or failed in this forward), or one of its GEMM CTAs stopped";
      break;
    case WaitTarget::kRankBarrier:
      out << "not every CTA of rank " << r.rank << " reached a barrier: the forward's CTAs were not all running "
          << "(another kernel holding SMs?) or one of them failed";
      break;
    case WaitTarget::kStageFull:
    case WaitTarget::kStageEmpty:
    case WaitTarget::kTileInfo:
    case WaitTarget::kTileInfoFree:
    case WaitTarget::kTileClaim:
    case WaitTarget::kCopyLanded:
      out << "a copy or GEMM pipeline inside one CTA of rank " << r.rank << " stopped (a faulting TMA or bulk "
          << "copy: check that the weights and tensors are valid device memory of the layer's GPU)";
      break;
    default:
      return "";
  }
  out << " [wait timeout: " << r.waited_ns / 1000000.0 << " ms; raise the wait timeout only if "
      << "ranks legitimately start far apart]. Details: ";
  return out.str();
}

std::string DeviceErrorSlot::describe() const {
  if (!has_error()) return "";
  const DeviceErrorRecord r = *host_;
  std::ostringstream out;
  if (DeviceErrorCode(r.code) == DeviceErrorCode::kWaitTimeout) out << likely_cause(r);
  out << "rank " << r.rank << ", " << role_name(r.role) << ", CTA " << r.block << ": ";
  switch (WaitTarget(r.target)) {
    case WaitTarget::kMBlockReady:
      out << "m-block " << r.index << " readiness counter stayed at " << r.observed << ", expected >= " << r.expected;
      break;
    case WaitTarget::kGemm1Done:
    case WaitTarget::kGemm2Done:
      out << "m-block " << r.index << " GEMM" << (WaitTarget(r.target) == WaitTarget::kGemm1Done ? 1 : 2)
          << " completion counter stayed at " << r.observed << ", expected >= " << r.expected;
      break;
    case WaitTarget::kSwigluDone:
      out << "m-block " << r.index << " SwiGLU-backward counter stayed at " << r.observed
          << ", expected >= " << r.expected;
      break;
    case WaitTarget::kHiddenQuantized:
      out << "m-block " << r.index << " hidden-row quantization counter stayed at " << r.observed
          << ", expected >= " << r.expected;
      break;
    case WaitTarget::kWgradInputs:
      out << "the weight gradients' count of " << (r.index == 0 ? "SwiGLU-backward items" : "x-row pulls")
          << " done stayed at " << r.observed << ", expected >= " << r.expected;
      break;
    case WaitTarget::kTokensQuantized:
      out << "rank " << r.index << "'s count of CTAs done quantizing its tokens stayed at " << r.observed
          << ", expected >= " << r.expected;
      break;
    case WaitTarget::kRingSlotFree:
      out << "ring slot of m-block " << r.index << " never freed: combine counter stayed at " << r.observed
          << ", expected >= " << r.expected;
      break;
    case WaitTarget::kTokenArrivals:
      out << "token " << r.index << " arrivals counter stayed at " << r.observed << ", expected >= " << r.expected;
      break;
    case WaitTarget::kRankBarrier:
      out << "barrier " << r.index << " among the rank's CTAs stayed at " << r.observed
          << " arrivals, expected >= " << r.expected;
      break;
    case WaitTarget::kStartFlag:
      out << "start flag of rank " << r.index << " stayed at " << r.observed << ", expected >= " << r.expected;
      break;
    case WaitTarget::kCopyLanded:
      out << "bulk copy into copy-engine slot " << r.index << " never landed, phase " << r.expected;
      break;
    case WaitTarget::kStageFull:
      out << "pipeline stage " << r.index << " never filled (TMA load did not complete), phase " << r.expected;
      break;
    case WaitTarget::kStageEmpty:
      out << "pipeline stage " << r.index << " never released by the consumers, phase " << r.expected;
      break;
    case WaitTarget::kTileInfo:
      out << "tile slot " << r.index << " never published by the producer, phase " << r.expected;
      break;
    case WaitTarget::kTileInfoFree:
      out << "tile slot " << r.index << " never released by the consumers, phase " << r.expected;
      break;
    case WaitTarget::kTileClaim:
      out << "the loader never let the tile fetcher claim its next tile, phase " << r.expected;
      break;
    case WaitTarget::kRowsInBounds:
      out << "expert_offsets[experts] = " << r.observed << " exceeds the " << r.expected << " rows of the A buffer";
      break;
    case WaitTarget::kExpertIdInRange:
      out << "topk_ids[token " << r.index << "][k " << r.position << "] = " << int32_t(r.observed)
          << " is out of range [0, " << r.expected << ")";
      break;
    case WaitTarget::kTokenCount:
      out << int64_t(r.observed) << " tokens, outside [0, max_tokens_per_rank = " << r.expected << "]";
      break;
    case WaitTarget::kKeptForward:
      out << "the backward was enqueued to start from the rows its training forward kept, but when it ran "
          << "those rows were another forward's (a CUDA graph replayed a forward in between, or a forward "
          << "ran on another stream): its gradients are wrong. Keep a forward and its backward in order on one "
          << "stream, captured together or not at all [kept rows of forward " << r.observed << ", latest forward "
          << r.expected << ", inputs " << (r.index ? "the same" : "others") << "]";
      break;
    case WaitTarget::kRouteCapacity:
      out << "the routing sends rank " << r.index << " " << r.observed << " routes, more than the " << r.expected
          << " its buffers hold (EpConfig::max_routes_per_rank; 0 sizes them for every route "
          << "of every rank's max_tokens_per_rank tokens): nothing was computed";
      break;
    case WaitTarget::kDistinctExperts:
      out << "token " << r.index << " lists expert " << r.observed << " twice (k " << r.expected << " and k "
          << r.position << ")";
      break;
    case WaitTarget::kOffsetsAligned:
      out << "expert_offsets[" << r.index << "] = " << int32_t(r.observed) << " is not a multiple of " << r.expected
          << ", or lies below the offset before it (or below 0)";
      break;
  }
  if (DeviceErrorCode(r.code) == DeviceErrorCode::kWaitTimeout)
    out << " (gave up after " << r.waited_ns / 1000000.0 << " ms)";
  return out.str();
}

void DeviceErrorSlot::check() {
  if (!has_error()) return;
  const std::string what = describe();
  reset();
  POUNCE_FAIL("kernel stopped: ", what);
}

// After a trap the context is gone and the memset fails; the record is what matters then.
void DeviceErrorSlot::reset() {
  std::memset(host_, 0, sizeof(DeviceErrorRecord));
  cudaMemset(reported_, 0, sizeof(uint32_t));
  cudaDeviceSynchronize();  // cleared before any kernel on any stream can read it
}

}  // namespace pounce
