#include <nccl_device.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <thread>

#include "comm/nccl_window.h"
#include "common/cuda_check.h"
#include "common/device_buffer.h"

namespace pounce::comm {
namespace {

// The one place NCCL's device API is called: LSA pointers of every peer into the peer table.
__global__ void lsa_pointers_kernel(ncclWindow_t window, int ranks, uint8_t** out) {
  const int peer = threadIdx.x;
  if (peer < ranks) out[peer] = static_cast<uint8_t*>(ncclGetLsaPointer(window, 0, peer));
}

std::string version_string(int code) {
  return std::to_string(code / 10000) + "." + std::to_string(code / 100 % 100) + "." + std::to_string(code % 100);
}

}  // namespace

std::string checked_nccl_version() {
  int runtime = 0;
  NCCL_CHECK(ncclGetVersion(&runtime));
  POUNCE_REQUIRE(runtime == NCCL_VERSION_CODE, "NCCL library ", version_string(runtime),
                 " differs from the headers pounce was built with (", version_string(NCCL_VERSION_CODE),
                 "): NCCL 2.28's device API needs them equal; build with -DNCCL_ROOT=<the NCCL you run with>");
  return version_string(runtime) + " (headers " + version_string(NCCL_VERSION_CODE) + ")";
}

void disable_multicast() {
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 1);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
}

std::vector<ncclComm_t> init_single_process_comms(const std::vector<int>& devices) {
  POUNCE_REQUIRE(!devices.empty() && int(devices.size()) <= PeerTable::kMaxRanks, "NCCL: ", devices.size(),
                 " devices; between 1 and ", PeerTable::kMaxRanks, " are supported");
  checked_nccl_version();
  disable_multicast();
  std::vector<ncclComm_t> comms(devices.size());
  NCCL_CHECK(ncclCommInitAll(comms.data(), int(devices.size()), devices.data()));
  return comms;
}

std::vector<ncclComm_t> init_single_process_comms_on_first(int gpus) {
  std::vector<int> devices(std::max(gpus, 0));
  std::iota(devices.begin(), devices.end(), 0);
  return init_single_process_comms(devices);
}

void destroy_single_process_comms(const std::vector<ncclComm_t>& comms) {
  NCCL_CHECK(ncclGroupStart());
  for (ncclComm_t c : comms) NCCL_CHECK(ncclCommFinalize(c));
  NCCL_CHECK(ncclGroupEnd());
  for (ncclComm_t c : comms) NCCL_CHECK(ncclCommDestroy(c));
}

ncclComm_t init_rank_from_file(const std::string& id_file, int rank, int ranks, double timeout_s) {
  POUNCE_REQUIRE(ranks >= 1 && ranks <= PeerTable::kMaxRanks && rank >= 0 && rank < ranks, "NCCL: rank ", rank, " of ",
                 ranks, " is not a valid rank of a group of 1 to ", PeerTable::kMaxRanks);
  checked_nccl_version();
  disable_multicast();
  ncclUniqueId id;
  if (rank == 0) {
    NCCL_CHECK(ncclGetUniqueId(&id));
    const std::string partial = id_file + ".partial";
    {
      std::ofstream out(partial, std::ios::binary | std::ios::trunc);
      out.write(reinterpret_cast<const char*>(&id), sizeof(id));
      POUNCE_REQUIRE(out.good(), "NCCL: cannot write the unique id to ", partial);
    }
    POUNCE_REQUIRE(std::rename(partial.c_str(), id_file.c_str()) == 0, "NCCL: cannot rename ", partial, " to ",
                   id_file);
  } else {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (;;) {
      std::ifstream in(id_file, std::ios::binary);
      if (in.read(reinterpret_cast<char*>(&id), sizeof(id))) break;
      POUNCE_REQUIRE(std::chrono::steady_clock::now() < deadline, "NCCL: rank ", rank, " waited ", timeout_s,
                     " s for rank 0's unique id in ", id_file);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  ncclComm_t comm;
  NCCL_CHECK(ncclCommInitRank(&comm, ranks, id, rank));
  // Every rank has joined, so every rank has read the id: a later run must not find it.
  if (rank == 0) std::remove(id_file.c_str());
  return comm;
}

void NcclWindow::require_team_is_communicator(const std::string& user) const {
  int rank = 0, ranks = 0;
  NCCL_CHECK(ncclCommUserRank(comm_, &rank));
  NCCL_CHECK(ncclCommCount(comm_, &ranks));
  POUNCE_REQUIRE(peers_.ranks == ranks && peers_.rank == rank, user, ": the communicator's NVLink (LSA) team has ",
                 peers_.ranks, " ranks and this is its rank ", peers_.rank, "; it needs all ", ranks,
                 " ranks in one NVLink domain, with the same numbering (this is rank ", rank, ")");
}

NcclWindow::NcclWindow(ncclComm_t comm, size_t bytes) : comm_(comm) {
  POUNCE_REQUIRE(bytes > 0, "NcclWindow: empty buffer");
  const ncclTeam_t lsa = ncclTeamLsa(comm);
  POUNCE_REQUIRE(lsa.nRanks >= 1 && lsa.nRanks <= PeerTable::kMaxRanks, "NCCL: the NVLink island has ", lsa.nRanks,
                 " ranks; pounce supports 1 to ", PeerTable::kMaxRanks);
  NCCL_CHECK(ncclMemAlloc(&buffer_, bytes));
  // Zeroed before the (collective) registration: once any rank is past it, peers may write here.
  CUDA_CHECK(cudaMemset(buffer_, 0, bytes));
  CUDA_CHECK(cudaDeviceSynchronize());
  NCCL_CHECK(ncclCommWindowRegister(comm, buffer_, bytes, &window_, NCCL_WIN_COLL_SYMMETRIC));

  DeviceBuffer<uint8_t*> pointers(PeerTable::kMaxRanks);
  lsa_pointers_kernel<<<1, PeerTable::kMaxRanks>>>(window_, lsa.nRanks, pointers.data());
  CUDA_CHECK_LAUNCH();
  const std::vector<uint8_t*> host = pointers.download();  // one-time setup: a host sync is fine here
  peers_.ranks = lsa.nRanks;
  peers_.rank = lsa.rank;
  peers_.bytes = bytes;
  for (int r = 0; r < lsa.nRanks; ++r) peers_.base[r] = host[r];
}

NcclWindow::~NcclWindow() {
  // No throwing from a destructor; teardown failures leak at worst.
  if (window_) ncclCommWindowDeregister(comm_, window_);
  if (buffer_) ncclMemFree(buffer_);
}

}  // namespace pounce::comm
