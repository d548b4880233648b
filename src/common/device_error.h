// Errors raised inside kernels. A kernel that gives up (a wait ran past its deadline, a schedule that
// breaks an invariant) writes one record here and stops; the host turns it into a pounce::Error that
// says who waited for what: "rank 0, gemm producer, CTA 17: m-block 42 readiness counter stayed at 3,
// expected >= 4 after 20 ms".
//
// The record lives in mapped pinned host memory, so the host can read it even after a kernel trapped
// (a trapped context can no longer copy device memory).
#pragma once

#include <cstdint>
#include <string>

namespace pounce {

enum class DeviceErrorCode : uint32_t {
  kNone = 0,
  kWaitTimeout = 1,  // a bounded wait expired
  kBadSchedule = 2,  // device-side inputs break an invariant (e.g. rows beyond the buffer)
  kBadRouting = 3,   // topk_ids: an expert id out of range, or an expert twice in one token
};

enum class DeviceRole : uint32_t {
  kGemmProducer = 0,
  kGemmConsumer = 1,
  kPlanner = 2,
  kDispatch = 3,     // fused kernel: pulls token rows into the ring
  kCombine = 4,      // fused kernel: pushes output rows to their source ranks
  kWeightedSum = 5,  // fused kernel: sums a completed token's k rows
  kRankSync = 6,     // fused kernel: barriers between phases
  kTileGate = 7,     // dispatch probe: waits where a GEMM producer would, timing the m-blocks' readiness
  kBackward = 8,     // the backward's check of the rows a training forward kept
};

// What the reporter was waiting for, or checking.
enum class WaitTarget : uint32_t {
  kMBlockReady = 0,       // readiness counter of an m-block (index = m-block)
  kStageFull = 1,         // TMA data of a pipeline stage (index = stage)
  kStageEmpty = 2,        // consumers releasing a pipeline stage (index = stage)
  kTileInfo = 3,          // producer publishing the next tile (index = slot)
  kTileInfoFree = 4,      // consumers releasing a tile slot (index = slot)
  kRowsInBounds = 5,      // not a wait: expert_offsets[E] (observed) > buffer rows (expected)
  kExpertIdInRange = 6,   // topk_ids[token = index][k = position] = observed, not in [0, expected)
  kDistinctExperts = 7,   // token index lists expert observed at k = expected and k = position
  kTokenCount = 8,        // a rank's token count (observed) outside [0, expected]
  kGemm1Done = 9,         // GEMM1 completion counter of m-block index
  kGemm2Done = 10,        // GEMM2 completion counter of m-block index
  kRingSlotFree = 11,     // combine of the m-block that last used the ring slot of m-block index
  kTokenArrivals = 12,    // combine arrivals of token index
  kRankBarrier = 13,      // arrivals at barrier index among one rank's CTAs
  kStartFlag = 14,        // start flag of rank index (the previous forward finished there)
  kCopyLanded = 15,       // a bulk copy into copy-engine slot index never landed
  kKeptForward = 16,      // not a wait: the kept rows are forward number observed's (0: the latest forward
                          // kept none), the latest is number expected; index 1 when the kept forward's inputs
                          // are the backward's
  kSwigluDone = 17,       // the fused backward's SwiGLU-backward counter of m-block index
  kOffsetsAligned = 18,   // not a wait: a grouped GEMM's expert_offsets[index] = observed is not a multiple of
                          // expected (128), or lies below the offset before it (or below 0)
  kHiddenQuantized = 19,  // the E4M3 forward's counter of m-block index's hidden rows quantized for GEMM2
  kTokensQuantized = 20,  // the E4M3 forward's count of rank index's CTAs that quantized their tokens
  kTileClaim = 21,        // the loader's go for the tile fetcher's next claim (a GEMM pipeline's own barrier)
  kRouteCapacity = 22,    // not a wait: rank index receives observed routes, more than its capacity (expected)
  kWgradInputs = 23,      // the fused backward's count of its rank's S items (index 0) or X items (index 1) done
};

struct DeviceErrorRecord {
  uint32_t claimed;  // first reporter wins; later ones leave the record alone
  uint32_t code;     // DeviceErrorCode, written last
  int32_t rank;      // the reporter's rank; for routing errors, the rank whose topk_ids are wrong
  uint32_t role;     // DeviceRole
  int32_t block;     // blockIdx.x of the reporter
  uint32_t target;   // WaitTarget
  int64_t index;
  int32_t position;  // a second coordinate where one is needed (the k of a routing entry)
  uint64_t expected;
  uint64_t observed;
  uint64_t waited_ns;
};

// Where kernels report: the mapped record (readable by the host even after a trap) and a word in device
// memory that says "someone reported". Waiters poll the word, never the record: a read of mapped host
// memory crosses PCIe, and a thousand waiting warps doing that slow the whole GPU down.
struct DeviceErrorSink {
  DeviceErrorRecord* record = nullptr;
  uint32_t* reported = nullptr;  // device memory; nonzero once a record was claimed
};

// Owns one mapped record. check() throws pounce::Error describing a reported error and clears it.
class DeviceErrorSlot {
 public:
  DeviceErrorSlot();
  ~DeviceErrorSlot();
  DeviceErrorSlot(const DeviceErrorSlot&) = delete;
  DeviceErrorSlot& operator=(const DeviceErrorSlot&) = delete;

  DeviceErrorSink device_sink() const { return {device_, reported_}; }
  bool has_error() const;
  std::string describe() const;  // empty when no error
  void check();                  // throws after a reported error (and resets the record)
  void reset();

 private:
  DeviceErrorRecord* host_ = nullptr;
  DeviceErrorRecord* device_ = nullptr;
  uint32_t* reported_ = nullptr;
};

#ifdef __CUDACC__
// Claims the record (first caller wins) and fills it. Visible to the host after the kernel ends or traps.
__device__ inline void report_device_error(const DeviceErrorSink& sink, DeviceErrorCode code, DeviceRole role,
                                           WaitTarget target, int64_t index, uint64_t expected, uint64_t observed,
                                           uint64_t waited_ns, int32_t rank = 0, int32_t position = 0) {
  DeviceErrorRecord* rec = sink.record;
  if (rec == nullptr) return;
  if (sink.reported != nullptr) atomicExch(sink.reported, 1u);
  if (atomicCAS(&rec->claimed, 0u, 1u) != 0u) return;
  rec->rank = rank;
  rec->position = position;
  rec->role = uint32_t(role);
  rec->block = int32_t(blockIdx.x);
  rec->target = uint32_t(target);
  rec->index = index;
  rec->expected = expected;
  rec->observed = observed;
  rec->waited_ns = waited_ns;
  __threadfence_system();  // the fields before the code that announces them
  *reinterpret_cast<volatile uint32_t*>(&rec->code) = uint32_t(code);
  __threadfence_system();
}

// True once any kernel thread has reported (device memory; cheap to poll).
__device__ inline bool device_error_reported(const DeviceErrorSink& sink) {
  return sink.reported != nullptr && *reinterpret_cast<volatile const uint32_t*>(sink.reported) != 0;
}
#endif

}  // namespace pounce
