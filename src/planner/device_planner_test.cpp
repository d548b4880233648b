// The device planner against the host planner: every array bit for bit, on fresh random routings.
#include "planner/device_planner.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "common/gpu.h"
#include "common/testing.h"
#include "reference/synthetic_routing.h"

namespace pounce::planner {
namespace {

using reference::RoutingPattern;
using ::testing::HasSubstr;

// Every rank's topk_ids on the device, and the pointer table the planner reads them through.
struct DeviceRouting {
  std::vector<DeviceBuffer<int32_t>> ids;
  DeviceBuffer<const int32_t*> table;
  DeviceBuffer<int32_t> tokens;

  DeviceRouting(const std::vector<std::vector<int32_t>>& host_ids, const std::vector<int32_t>& token_counts) {
    std::vector<const int32_t*> pointers;
    for (const auto& v : host_ids) {
      ids.emplace_back(std::max<size_t>(v.size(), 1));  // a valid pointer even for a rank without tokens
      ids.back().upload(v);
      pointers.push_back(ids.back().data());
    }
    table = DeviceBuffer<const int32_t*>(pointers);
    tokens = DeviceBuffer<int32_t>(token_counts);
  }
};

template <typename T>
std::vector<T> download_prefix(const T* device, int64_t n) {
  std::vector<T> host(n);
  if (n > 0) CUDA_CHECK(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

struct Case {
  int ranks;
  RoutingPattern pattern;
  int experts, topk;
  int64_t max_tokens, minibatch_rows;
};

void PrintTo(const Case& c, std::ostream* out) {
  *out << "P" << c.ranks << "_" << reference::routing_pattern_name(c.pattern) << "_E" << c.experts << "_k" << c.topk
       << "_T" << c.max_tokens;
}

class DevicePlannerTest : public ::testing::TestWithParam<Case> {};

TEST_P(DevicePlannerTest, MatchesHostPlannerBitForBit) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const Case c = GetParam();
  const EpConfig config{.ranks = c.ranks,
                        .experts = c.experts,
                        .topk = c.topk,
                        .hidden = 64,
                        .intermediate = 64,
                        .max_tokens_per_rank = c.max_tokens};
  std::vector<std::vector<int32_t>> ids(c.ranks);
  std::vector<int64_t> tokens(c.ranks);
  std::vector<int32_t> tokens32(c.ranks);
  std::uniform_int_distribution<int64_t> count(0, c.max_tokens);
  for (int r = 0; r < c.ranks; ++r) {
    tokens[r] = r == 0 ? c.max_tokens : r == 1 ? 0 : r == 2 ? 1 : count(rng);
    tokens32[r] = int32_t(tokens[r]);
    ids[r] = reference::synthetic_topk_ids(c.pattern, tokens[r], c.experts, c.topk, rng);
  }
  DeviceRouting routing(ids, tokens32);
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());

  DevicePlanner planner(config, c.minibatch_rows);
  const int64_t capacity = planner.capacity().max_padded_rows;
  for (int rank = 0; rank < c.ranks; ++rank) {
    SCOPED_TRACE(::testing::Message() << "rank " << rank);
    const RankSchedule want = build_schedule(config, rank, views, tokens, c.minibatch_rows);
    planner.plan(rank, routing.table.data(), routing.tokens.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    planner.check_device_errors();

    const auto sizes = download_prefix(planner.sizes(), 1).front();
    EXPECT_EQ(sizes.routes, want.routes());
    EXPECT_EQ(sizes.padded_rows, want.padded_rows());
    EXPECT_EQ(sizes.m_blocks, want.m_blocks());
    EXPECT_EQ(sizes.minibatches, want.minibatches());
    const int local = config.local_experts();
    EXPECT_EQ(download_prefix(planner.expert_routes(), local), want.expert_routes);
    EXPECT_EQ(download_prefix(planner.expert_offsets(), local + 1), want.expert_offsets);
    EXPECT_EQ(download_prefix(planner.minibatch_starts(), want.minibatch_starts.size()), want.minibatch_starts);
    // Routed rows in order, -1 for padding and for every row past the schedule.
    std::vector<int32_t> padding(capacity - want.padded_rows(), -1);
    auto expect_rows = [&](const int32_t* device, const std::vector<int32_t>& host, const char* what) {
      const auto all = download_prefix(device, capacity);
      EXPECT_TRUE(std::equal(host.begin(), host.end(), all.begin())) << what << " differs from the host planner";
      EXPECT_TRUE(std::equal(padding.begin(), padding.end(), all.begin() + want.padded_rows()))
          << what << ": rows past the schedule are not -1";
    };
    expect_rows(planner.row_source_rank(), want.row_source_rank, "row_source_rank");
    expect_rows(planner.row_token(), want.row_token, "row_token");
    expect_rows(planner.row_k(), want.row_k, "row_k");
    // The inverse map: every routed row is where route_row says its route went.
    const auto route_row = download_prefix(planner.route_row(), c.ranks * c.max_tokens * c.topk);
    int64_t mismatches = 0;
    for (int64_t row = 0; row < want.padded_rows(); ++row) {
      if (want.row_token[row] < 0) continue;
      const int64_t route =
          (int64_t(want.row_source_rank[row]) * c.max_tokens + want.row_token[row]) * c.topk + want.row_k[row];
      mismatches += route_row[route] != row;
    }
    EXPECT_EQ(mismatches, 0) << "route_row disagrees with the placed rows";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Routings, DevicePlannerTest,
    ::testing::Values(Case{1, RoutingPattern::kUniform, 32, 8, 8192, 2432},  // the DeepSeek-V3 slice
                      Case{2, RoutingPattern::kZipf, 16, 4, 700, 128},
                      Case{4, RoutingPattern::kOneExpert, 64, 6, 300, 1000},
                      Case{8, RoutingPattern::kUniform, 256, 8, 1024, 2432},
                      Case{8, RoutingPattern::kHalfEmpty, 16, 2, 257, 300},
                      Case{1, RoutingPattern::kZipf, 1024, 1, 513, 128},    // the most local experts supported
                      Case{2, RoutingPattern::kUniform, 64, 40, 100, 128},  // top-k past one warp
                      Case{2, RoutingPattern::kUniform, 2, 2, 0, 128}),     // no tokens anywhere
    testing::NameFromPrintTo());

TEST(DevicePlanner, ReportsBadRoutingByName) {
  POUNCE_REQUIRE_HOPPER();
  const EpConfig config{
      .ranks = 2, .experts = 32, .topk = 3, .hidden = 64, .intermediate = 64, .max_tokens_per_rank = 8};
  DevicePlanner planner(config, 128);
  auto expect_error = [&](std::vector<std::vector<int32_t>> ids, std::vector<int32_t> tokens, const char* message) {
    DeviceRouting routing(ids, tokens);
    planner.plan(0, routing.table.data(), routing.tokens.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_THAT(testing::error_message([&] { planner.check_device_errors(); }), HasSubstr(message));
  };
  std::vector<int32_t> good = {0, 1, 2, 3, 4, 5};
  expect_error({good, {0, 1, 2, 3, 40, 5}}, {2, 2}, "rank 1, planner, CTA");
  expect_error({good, {0, 1, 2, 3, 40, 5}}, {2, 2}, "topk_ids[token 1][k 1] = 40 is out of range [0, 32)");
  expect_error({{0, 1, 2, 7, 9, 7}, good}, {2, 2}, "token 1 lists expert 7 twice (k 0 and k 2)");
  expect_error({good, {0, -3, 2, 3, 4, 5}}, {2, 2}, "topk_ids[token 0][k 1] = -3 is out of range");
  // A count past max_tokens is clamped to it (buffers hold max_tokens rows) and reported.
  std::vector<int32_t> full(8 * 3);
  for (size_t i = 0; i < full.size(); ++i) full[i] = int32_t(i % 3);
  expect_error({good, full}, {2, 9}, "rank 1, planner, CTA 1: 9 tokens, outside [0, max_tokens_per_rank = 8]");
  // Good input after all that: no error left behind.
  DeviceRouting routing({good, good}, {2, 2});
  planner.plan(1, routing.table.data(), routing.tokens.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_NO_THROW(planner.check_device_errors());
}

// A routing that sends some rank more routes than max_routes_per_rank: every rank's planner reports it
// (naming that rank) and leaves an empty schedule; at the capacity exactly, the host planner's schedule.
TEST(DevicePlanner, StopsARoutingPastTheCapacityOnEveryRank) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  EpConfig config{.ranks = 3, .experts = 12, .topk = 2, .hidden = 64, .intermediate = 64, .max_tokens_per_rank = 300};
  const std::vector<int64_t> tokens = {300, 211, 7};
  std::vector<std::vector<int32_t>> ids(3);
  for (int r = 0; r < 3; ++r)
    ids[r] = reference::synthetic_topk_ids(RoutingPattern::kZipf, tokens[r], config.experts, config.topk, rng);
  std::vector<int64_t> routes(3, 0);
  for (const auto& rank_ids : ids)
    for (int32_t id : rank_ids) ++routes[id / config.local_experts()];
  const int busiest = int(std::max_element(routes.begin(), routes.end()) - routes.begin());
  DeviceRouting routing(ids, {300, 211, 7});
  std::vector<std::span<const int32_t>> views(ids.begin(), ids.end());

  const int64_t worst_rows = row_capacity(config).max_padded_rows;
  config.max_routes_per_rank = routes[busiest] - 1;
  DevicePlanner tight(config, 128);
  EXPECT_LT(tight.capacity().max_padded_rows, worst_rows);
  for (int rank = 0; rank < 3; ++rank) {
    SCOPED_TRACE(::testing::Message() << "rank " << rank);
    tight.plan(rank, routing.table.data(), routing.tokens.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_THAT(testing::error_message([&] { tight.check_device_errors(); }),
                HasSubstr("the routing sends rank " + std::to_string(busiest) + " " + std::to_string(routes[busiest]) +
                          " routes, more than the " + std::to_string(routes[busiest] - 1)));
    const auto sizes = download_prefix(tight.sizes(), 1).front();
    EXPECT_EQ(sizes.routes, 0);
    EXPECT_EQ(sizes.padded_rows, 0);
    EXPECT_EQ(sizes.m_blocks, 0);
    EXPECT_EQ(sizes.minibatches, 0);
    const int local = config.local_experts();
    EXPECT_EQ(download_prefix(tight.expert_offsets(), local + 1), std::vector<int32_t>(local + 1, 0));
    EXPECT_EQ(download_prefix(tight.expert_routes(), local), std::vector<int32_t>(local, 0));
    EXPECT_EQ(download_prefix(tight.minibatch_starts(), 1), std::vector<int32_t>{0});
  }

  config.max_routes_per_rank = routes[busiest];
  DevicePlanner exact(config, 128);
  for (int rank = 0; rank < 3; ++rank) {
    exact.plan(rank, routing.table.data(), routing.tokens.data(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_NO_THROW(exact.check_device_errors());
    const RankSchedule want = build_schedule(config, rank, views, tokens, 128);
    EXPECT_EQ(download_prefix(exact.sizes(), 1).front().padded_rows, want.padded_rows());
    EXPECT_EQ(download_prefix(exact.row_token(), want.padded_rows()), want.row_token);
  }
}

// With bad ids the forward stops, but the schedule's steps still run: count and place must skip the same
// entries (out of range, or an expert repeated within a token), or place would write rows past the
// counted ones. Duplicates on both sides of a 32-entry step and past k = 32 included.
TEST(DevicePlanner, PlacesExactlyTheEntriesItCountsWhenRoutingIsBad) {
  POUNCE_REQUIRE_HOPPER();
  auto rng = testing::fresh_rng();
  const int experts = 48, topk = 40, tokens = 100;
  const EpConfig config{
      .ranks = 1, .experts = experts, .topk = topk, .hidden = 64, .intermediate = 64, .max_tokens_per_rank = tokens};
  std::uniform_int_distribution<int32_t> any_id(-2, experts + 1);  // a few out of range, many repeats
  std::vector<int32_t> ids(tokens * topk);
  for (auto& id : ids) id = any_id(rng);
  // The rule on the host: rows of each expert in (token, k) order.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> want(experts);
  for (int32_t t = 0; t < tokens; ++t)
    for (int32_t j = 0; j < topk; ++j) {
      const int32_t* row = ids.data() + t * topk;
      if (row[j] >= 0 && row[j] < experts && std::find(row, row + j, row[j]) == row + j) want[row[j]].push_back({t, j});
    }
  DeviceRouting routing({ids}, {tokens});
  DevicePlanner planner(config, 128);
  planner.plan(0, routing.table.data(), routing.tokens.data(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_THAT(testing::error_message([&] { planner.check_device_errors(); }), HasSubstr("rank 0, planner"));

  const auto routes = download_prefix(planner.expert_routes(), experts);
  const auto offsets = download_prefix(planner.expert_offsets(), experts + 1);
  const auto row_token = download_prefix(planner.row_token(), planner.capacity().max_padded_rows);
  const auto row_k = download_prefix(planner.row_k(), planner.capacity().max_padded_rows);
  for (int e = 0; e < experts; ++e) {
    SCOPED_TRACE(::testing::Message() << "expert " << e);
    ASSERT_EQ(routes[e], int32_t(want[e].size()));
    for (int32_t i = 0; i < offsets[e + 1] - offsets[e]; ++i) {
      const int32_t row = offsets[e] + i;
      const std::pair<int32_t, int32_t> placed{row_token[row], row_k[row]};
      const std::pair<int32_t, int32_t> expected = i < routes[e] ? want[e][i] : std::make_pair(-1, -1);
      EXPECT_EQ(placed, expected) << "row " << row;
    }
  }
}

}  // namespace
}  // namespace pounce::planner
