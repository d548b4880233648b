// The NCCL backend: at one rank on one GPU (NCCL refuses two ranks on one GPU) the version check, window
// registration and LSA pointers that address the rank's own buffer; and the unique-id file handshake.
#include "comm/nccl_window.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "common/cuda_check.h"
#include "common/gpu.h"
#include "common/testing.h"

namespace pounce::comm {
namespace {

TEST(Nccl, LibraryMatchesHeaders) {
  POUNCE_REQUIRE_HOPPER();
  const std::string version = checked_nccl_version();
  std::printf("NCCL %s\n", version.c_str());
  EXPECT_THAT(version, ::testing::StartsWith("2.28."));
}

TEST(Nccl, OneRankWindowPeerPointerIsTheLocalBuffer) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  std::vector<ncclComm_t> comms = init_single_process_comms({0});
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  {
    const size_t bytes = size_t(4) << 20;
    NcclWindow window(comms[0], bytes);
    const PeerTable& peers = window.peers();
    ASSERT_EQ(peers.ranks, 1);
    ASSERT_EQ(peers.rank, 0);
    ASSERT_NE(peers.base[0], nullptr);

    // Written through the peer pointer, read through the local one (and back).
    std::vector<uint32_t> pattern(bytes / 4), got(bytes / 4, 0);
    for (auto& v : pattern) v = uint32_t(rng());
    CUDA_CHECK(cudaMemcpy(peers.at(0, 0), pattern.data(), bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(got.data(), window.local(), bytes, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, pattern);
    const size_t offset = bytes / 2;
    uint32_t word = 0;
    CUDA_CHECK(cudaMemcpy(&word, peers.at(0, offset), 4, cudaMemcpyDeviceToHost));
    EXPECT_EQ(word, pattern[offset / 4]);
  }
  comm::destroy_single_process_comms(comms);
}

// One process per GPU: a rank other than 0 waits for rank 0's unique-id file and, past its deadline,
// fails naming the file (no GPU needed: it never gets as far as NCCL's communicator). Bad rank numbers
// are refused before anything else.
TEST(Nccl, RankWithoutTheUniqueIdFileGivesUpNamingIt) {
  const std::string path = ::testing::TempDir() + "pounce_no_such_nccl_id_" + std::to_string(::getpid());
  testing::expect_error([&] { init_rank_from_file(path, 1, 2, 0.05); }, "s for rank 0's unique id in " + path);
  testing::expect_error([&] { init_rank_from_file(path, 2, 2); }, "rank 2 of 2 is not a valid rank");
}

}  // namespace
}  // namespace pounce::comm
