// The dispatch probe (pull against push, moe/dispatch_probe.h) on fresh random tokens and routings: after
// a run every routed row of every rank's ring holds its x row bit for bit, padding rows keep the poison,
// and pull and push give identical rings — on virtual ranks, on one NCCL rank and across every GPU. A
// stalled rank must end in a timeout error naming the counter, not a hang.
#include "dispatch_probe/dispatch_probe.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <numeric>
#include <optional>

#include "comm/gpu_threads.h"
#include "comm/nccl_window.h"
#include "common/gpu.h"
#include "common/testing.h"
#include "moe/fused_params.h"
#include "reference/synthetic_routing.h"

namespace pounce::moe {
namespace {

using reference::RoutingPattern;
using ::testing::HasSubstr;
using Ring = std::vector<uint16_t>;  // bf16 bits, ring_blocks * 128 rows of H

struct Case {
  int ranks;
  int64_t tokens;  // rank r gets tokens + r (odd and differing counts)
  int64_t hidden;
  int experts, topk;
  RoutingPattern pattern;
  int64_t ring_blocks = 0;  // 0: every m-block
  int comm_ctas = 2;
  int engine_rows = -1;  // -1: the default for the row length
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "P" << c.ranks << "_T" << c.tokens << "_H" << c.hidden << "_E" << c.experts << "_k" << c.topk << "_"
       << reference::routing_pattern_name(c.pattern) << "_comm" << c.comm_ctas;
  if (c.ring_blocks) *out << "_ring" << c.ring_blocks;
  if (c.engine_rows >= 0) *out << "_engine" << c.engine_rows;
}

// Every rank's tokens and routing, on the host.
struct Inputs {
  EpConfig config;
  std::vector<std::vector<uint16_t>> x;  // [tokens_r * H] bf16 bits
  std::vector<std::vector<int32_t>> ids;
};

Inputs make_inputs(std::mt19937_64& rng, const Case& c) {
  Inputs in;
  in.config = {.ranks = c.ranks,
               .experts = c.experts,
               .topk = c.topk,
               .hidden = c.hidden,
               .intermediate = 64,
               .max_tokens_per_rank = c.tokens + c.ranks};
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t t = c.tokens + r;
    in.x.push_back(testing::to_bf16_bits(testing::random_bf16_values(rng, t * c.hidden)));
    in.ids.push_back(reference::synthetic_topk_ids(c.pattern, t, c.experts, c.topk, rng));
  }
  return in;
}

// What rank d's ring must hold: x[source][token] at every routed row of its first ring_blocks m-blocks,
// the poison (0xFFFF) everywhere else.
Ring expected_ring(const Inputs& in, int d, int64_t ring_blocks) {
  const int64_t H = in.config.hidden;
  std::vector<std::span<const int32_t>> ids(in.ids.begin(), in.ids.end());
  std::vector<int64_t> tokens;
  for (const auto& r : in.ids) tokens.push_back(int64_t(r.size()) / in.config.topk);
  const planner::RankSchedule s = planner::build_schedule(in.config, d, ids, tokens, kBlockM);
  Ring ring(ring_blocks * kBlockM * H, 0xFFFF);
  const int64_t rows = std::min(ring_blocks, s.m_blocks()) * kBlockM;
  for (int64_t row = 0; row < rows; ++row)
    if (s.row_source_rank[row] >= 0) {
      const uint16_t* src = in.x[s.row_source_rank[row]].data() + s.row_token[row] * H;
      std::copy(src, src + H, ring.begin() + row * H);
    }
  return ring;
}

// "" when equal, else the first differing ring row (gtest would print millions of elements).
std::string first_difference(const Ring& got, const Ring& want, int64_t H) {
  if (got.size() != want.size()) return "sizes " + std::to_string(got.size()) + " vs " + std::to_string(want.size());
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return "ring row " + std::to_string(i / H) + ", element " + std::to_string(i % H) + ": " +
             std::to_string(got[i]) + " vs " + std::to_string(want[i]);
  return "";
}

void upload_x(const DispatchProbe& probe, const Inputs& in, int rank) {
  const auto& x = in.x[rank];
  if (!x.empty()) CUDA_CHECK(cudaMemcpy(probe.x(rank), x.data(), x.size() * sizeof(uint16_t), cudaMemcpyHostToDevice));
}

// One run in `mode` of this GPU's `ranks` on freshly poisoned rings; checks the counts it reports and
// returns the rings.
std::vector<Ring> run_mode(DispatchProbe& probe, DispatchMode mode, std::span<const int> ranks) {
  const size_t ring_elements = probe.ring_blocks() * kBlockM * size_t(probe.config().hidden);
  for (int r : ranks) CUDA_CHECK(cudaMemset(probe.ring(r), 0xFF, ring_elements * sizeof(uint16_t)));
  const DispatchRun run = probe.run(mode, nullptr);
  EXPECT_EQ(run.ranks.size(), ranks.size());
  EXPECT_GT(run.launch_ms, 0);
  std::vector<Ring> rings;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const DispatchRankTimes& t = run.ranks[i];
    EXPECT_EQ(t.rank, ranks[i]);
    EXPECT_LE(t.rows, t.blocks * kBlockM);
    EXPECT_GE(t.rows, t.blocks);
    EXPECT_LE(t.remote_rows, t.rows);
    EXPECT_GE(t.first_us, 0);
    EXPECT_GE(t.all_us, t.first_us);
    Ring ring(ring_elements);
    CUDA_CHECK(cudaMemcpy(ring.data(), probe.ring(ranks[i]), ring.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    rings.push_back(std::move(ring));
  }
  return rings;
}

constexpr DispatchMode kModes[] = {DispatchMode::kPull, DispatchMode::kPush};

// Pull, push, then pull again (start flags count runs, counters are cleared per run): every ring as
// expected each time, and push's rings identical to pull's.
void expect_rings_in_every_mode(DispatchProbe& probe, const Inputs& in, std::span<const int> ranks) {
  std::vector<std::vector<Ring>> runs;
  for (DispatchMode mode : {DispatchMode::kPull, DispatchMode::kPush, DispatchMode::kPull}) {
    SCOPED_TRACE(dispatch_mode_name(mode));
    runs.push_back(run_mode(probe, mode, ranks));
    for (size_t i = 0; i < ranks.size(); ++i)
      EXPECT_EQ(first_difference(runs.back()[i], expected_ring(in, ranks[i], probe.ring_blocks()), in.config.hidden),
                "")
          << "rank " << ranks[i];
  }
  for (size_t i = 0; i < ranks.size(); ++i)
    EXPECT_EQ(first_difference(runs[1][i], runs[0][i], in.config.hidden), "") << "push vs pull, rank " << ranks[i];
}

std::vector<int> all_ranks(int P) {
  std::vector<int> ranks(P);
  std::iota(ranks.begin(), ranks.end(), 0);
  return ranks;
}

class DispatchProbeTest : public ::testing::TestWithParam<Case> {};

TEST_P(DispatchProbeTest, PullAndPushFillEveryRingWithItsRowsOnVirtualRanks) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  const Inputs in = make_inputs(rng, c);
  DispatchProbe probe(in.config, in.ids,
                      {.comm_ctas = c.comm_ctas, .engine_rows = c.engine_rows, .ring_blocks = c.ring_blocks});
  if (c.engine_rows >= 0) {
    EXPECT_EQ(probe.engine_rows(), c.engine_rows);
  }
  for (int r = 0; r < c.ranks; ++r) upload_x(probe, in, r);
  expect_rings_in_every_mode(probe, in, all_ranks(c.ranks));
}

INSTANTIATE_TEST_SUITE_P(VirtualRanks, DispatchProbeTest,
                         ::testing::Values(Case{1, 300, 256, 8, 2, RoutingPattern::kUniform},
                                           Case{1, 1000, 512, 16, 4, RoutingPattern::kZipf, 3},
                                           Case{2, 0, 128, 8, 2, RoutingPattern::kUniform},
                                           Case{2, 501, 256, 8, 4, RoutingPattern::kUniform, 0, 4},
                                           Case{2, 777, 384, 16, 6, RoutingPattern::kZipf, 0, 1},
                                           Case{4, 300, 256, 16, 4, RoutingPattern::kUniform, 0, 3},
                                           Case{4, 999, 1024, 32, 8, RoutingPattern::kZipf, 2, 5},
                                           // move_rows' split: warps only, the engine only, and some of each.
                                           Case{2, 640, 512, 8, 4, RoutingPattern::kZipf, 0, 3, 0},
                                           Case{2, 640, 512, 8, 4, RoutingPattern::kZipf, 0, 3, 128},
                                           Case{1, 300, 2048, 8, 2, RoutingPattern::kUniform, 0, 2, 7}),
                         testing::NameFromPrintTo());

// The NCCL transport at one rank: rows read and written through the symmetric window.
TEST(DispatchProbe, NcclOneRankFillsItsRingInBothModes) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Inputs in = make_inputs(rng, Case{1, 1500, 512, 16, 4, RoutingPattern::kZipf});
  std::vector<ncclComm_t> comms = comm::init_single_process_comms({0});
  {
    DispatchProbe probe(in.config, in.ids, comms[0], {.comm_ctas = 3});
    upload_x(probe, in, 0);
    expect_rings_in_every_mode(probe, in, all_ranks(1));
  }
  comm::destroy_single_process_comms(comms);
}

// One NCCL rank per visible GPU (2 to 8), a thread each: pull reads peers' x over NVLink, push writes
// peers' rings and counters (system scope). Rings as expected, pull and push identical.
TEST(DispatchProbeMultiGpu, OneRankPerGpuFillsEveryRingInBothModes) {
  POUNCE_REQUIRE_HOPPER();
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess) gpus = 0;
  const int P = std::min(gpus, 8);
  if (P < 2) GTEST_SKIP() << "needs at least two GPUs; this machine has " << P;
  auto rng = testing::fresh_rng();
  std::vector<ncclComm_t> comms = comm::init_single_process_comms_on_first(P);
  for (RoutingPattern pattern : {RoutingPattern::kUniform, RoutingPattern::kZipf}) {
    SCOPED_TRACE(reference::routing_pattern_name(pattern));
    const Inputs in = make_inputs(rng, Case{P, 700, 512, 4 * P, 3, pattern});
    std::vector<std::optional<DispatchProbe>> probes(P);
    std::vector<std::vector<Ring>> rings(P);  // [rank][pull, push, pull]
    std::vector<int64_t> ring_blocks(P);
    const std::vector<std::string> failures = comm::run_on_every_gpu(
        P, [](int) {},
        [&](int r) {
          DispatchProbe& probe = probes[r].emplace(in.config, in.ids, comms[r], DispatchProbeOptions{.comm_ctas = 4});
          upload_x(probe, in, r);
          ring_blocks[r] = probe.ring_blocks();
          for (DispatchMode mode : {DispatchMode::kPull, DispatchMode::kPush, DispatchMode::kPull})
            rings[r].push_back(run_mode(probe, mode, std::vector<int>{r}).front());
        },
        [&](int r) { probes[r].reset(); });
    for (int r = 0; r < P; ++r) {
      ASSERT_EQ(failures[r], "") << "rank " << r;
      const Ring want = expected_ring(in, r, ring_blocks[r]);
      ASSERT_EQ(rings[r].size(), 3u);
      for (size_t run = 0; run < rings[r].size(); ++run)
        EXPECT_EQ(first_difference(rings[r][run], want, in.config.hidden), "") << "rank " << r << ", run " << run;
      EXPECT_EQ(first_difference(rings[r][1], rings[r][0], in.config.hidden), "") << "push vs pull, rank " << r;
    }
  }
  comm::destroy_single_process_comms(comms);
}

// One rank's communication CTAs move nothing: pull leaves its own m-blocks empty, push leaves every rank
// short of that source's rows. Each must end in a timeout naming the counter, and the probe refuses to
// run again.
TEST(DispatchProbe, StalledRankEndsInATimeoutErrorNamingTheCounter) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Inputs in = make_inputs(rng, Case{2, 400, 256, 8, 4, RoutingPattern::kUniform});
  for (DispatchMode mode : kModes) {
    SCOPED_TRACE(dispatch_mode_name(mode));
    DispatchProbe probe(in.config, in.ids, {.comm_ctas = 2, .wait_timeout_ns = 100'000'000, .stall_rank = 1});
    for (int r = 0; r < 2; ++r) upload_x(probe, in, r);
    const std::string message = testing::error_message([&] { probe.run(mode, nullptr); });
    EXPECT_THAT(message, HasSubstr("tile gate"));
    EXPECT_THAT(message, HasSubstr("readiness counter stayed at"));
    EXPECT_THAT(message, HasSubstr("gave up after"));
    if (mode == DispatchMode::kPull) {
      EXPECT_THAT(message, HasSubstr("rank 1, tile gate"));
    }
    testing::expect_error([&] { probe.run(mode, nullptr); }, "an earlier run failed");
  }
}

TEST(DispatchProbe, RejectsBadOptionsAndRoutingWithClearErrors) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Inputs in = make_inputs(rng, Case{2, 10, 128, 8, 2, RoutingPattern::kUniform});
  testing::expect_error([&] { DispatchProbe bad(in.config, in.ids, {.comm_ctas = 0}); }, "must be at least 1");
  testing::expect_error([&] { DispatchProbe bad(in.config, in.ids, {.comm_ctas = 1000}); }, "multiprocessors");
  testing::expect_error([&] { DispatchProbe bad(in.config, in.ids, {.engine_rows = 129}); },
                        "engine_rows = 129 must be -1 (default) or in [0, 128]");
  testing::expect_error([&] { DispatchProbe bad(in.config, in.ids, {.engine_rows = -2}); }, "engine_rows = -2");
  EXPECT_EQ(DispatchProbe(in.config, in.ids).engine_rows(), balanced_engine_rows(in.config.hidden * 2));
  testing::expect_error([&] { DispatchProbe bad(in.config, std::span(in.ids).first(1)); }, "routing of 1 ranks");
  auto ids = in.ids;
  ids[1][3] = 8;
  testing::expect_error([&] { DispatchProbe bad(in.config, ids); }, "is out of range [0, 8)");
}

}  // namespace
}  // namespace pounce::moe
