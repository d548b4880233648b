// NCCL backend of the peer table (NCCL 2.28 device API, LSA part): a symmetric buffer allocated with
// ncclMemAlloc and registered as a symmetric window, whose load/store pointers for every rank of the
// NVLink island come from ncclGetLsaPointer in a one-time setup kernel. Never multicast: the
// communicator helpers force NCCL_NVLS_ENABLE=0 (and the PyTorch / NVSHMEM equivalents) before init.
#pragma once

#include <nccl.h>

#include <string>
#include <vector>

#include "comm/peer_table.h"
#include "common/require.h"

namespace pounce::comm {

#define NCCL_CHECK(expr)                                                                                         \
  do {                                                                                                           \
    ncclResult_t pounce_nccl_status_ = (expr);                                                                   \
    if (pounce_nccl_status_ != ncclSuccess)                                                                      \
      POUNCE_FAIL(#expr, " failed at ", __FILE__, ":", __LINE__, ": ", ncclGetErrorString(pounce_nccl_status_)); \
  } while (0)

// "2.28.9 (headers 2.28.9)". Throws pounce::Error when the library and the headers differ: 2.28's device
// API requires the NCCL pounce was compiled against.
std::string checked_nccl_version();

// Turns NVLink multicast off for NCCL, PyTorch symmetric memory and NVSHMEM in this process (it can take
// shared machines down); called before any communicator is created.
void disable_multicast();

// One communicator per listed device, all in this process (ncclCommInitAll). Caller destroys them with
// destroy_single_process_comms.
std::vector<ncclComm_t> init_single_process_comms(const std::vector<int>& devices);
// The same on GPUs 0 .. gpus-1.
std::vector<ncclComm_t> init_single_process_comms_on_first(int gpus);

// Destroys the communicators of init_single_process_comms. Finalizing is collective across them: one
// thread finalizes them all in one NCCL group, then destroys each (destroying them one by one without
// that would wait on peers not yet destroyed).
void destroy_single_process_comms(const std::vector<ncclComm_t>& comms);

// One process per GPU: this process's communicator as `rank` of `ranks` on the current device. Rank 0
// writes the NCCL unique id to `id_file` (a path every rank can read, written atomically by rename);
// the others wait for it, up to `timeout_s` seconds, then fail naming the file. Rank 0 removes the file
// once every rank has joined; a run that crashed may leave one behind, so launchers pass a fresh path
// per run. Caller destroys the communicator.
ncclComm_t init_rank_from_file(const std::string& id_file, int rank, int ranks, double timeout_s = 60);

// One rank's symmetric window carved into regions, each 256-byte aligned (the same layout on every rank).
class WindowLayout {
 public:
  size_t add(size_t bytes) {  // returns the region's offset
    const size_t at = bytes_;
    bytes_ += (bytes + 255) / 256 * 256;
    return at;
  }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

// A symmetric buffer of `bytes` on every rank of `comm`, zeroed. Construction and destruction are collective:
// every rank must create and destroy its window in the same order.
class NcclWindow {
 public:
  NcclWindow(ncclComm_t comm, size_t bytes);
  ~NcclWindow();
  NcclWindow(const NcclWindow&) = delete;
  NcclWindow& operator=(const NcclWindow&) = delete;

  void* local() const { return buffer_; }
  const PeerTable& peers() const { return peers_; }
  // Throws, naming `user`, unless the NVLink (LSA) team is the whole communicator with the same rank
  // numbering: what a peer table indexed by communicator rank needs.
  void require_team_is_communicator(const std::string& user) const;

 private:
  ncclComm_t comm_;
  void* buffer_ = nullptr;
  ncclWindow_t window_ = nullptr;
  PeerTable peers_;
};

}  // namespace pounce::comm
