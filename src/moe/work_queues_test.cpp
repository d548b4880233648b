// The communication queue's order (moe/work_queues.h): every m-block is pulled in once and pushed out
// once, after it was pulled in, and a ring slot is refilled only after its previous tenant was pushed.
#include <gtest/gtest.h>

#include <vector>

#include "moe/work_queues.h"

namespace pounce::moe {
namespace {

TEST(CommQueue, EachMBlockOnceInOnceOutAndRingSlotsFreedBeforeReuse) {
  for (int32_t m_blocks : {0, 1, 2, 3, 7, 32, 33, 100})
    for (int32_t ring : {1, 2, 3, 8, 32, 64, 200}) {
      SCOPED_TRACE("M " + std::to_string(m_blocks) + ", R " + std::to_string(ring));
      std::vector<int64_t> pulled(m_blocks, -1), pushed(m_blocks, -1);
      for (int64_t i = 0; i < 2 * int64_t(m_blocks); ++i) {
        const CommItem item = comm_item(i, m_blocks, ring);
        ASSERT_GE(item.m_block, 0);
        ASSERT_LT(item.m_block, m_blocks);
        int64_t& at = item.combine ? pushed[item.m_block] : pulled[item.m_block];
        ASSERT_EQ(at, -1) << "m-block " << item.m_block << " twice as " << (item.combine ? "C" : "D");
        at = i;
      }
      for (int32_t b = 0; b < m_blocks; ++b) {
        ASSERT_GE(pulled[b], 0);
        ASSERT_GT(pushed[b], pulled[b]) << "C(" << b << ") before D(" << b << ")";
        if (b >= ring) {
          EXPECT_LT(pushed[b - ring], pulled[b]) << "D(" << b << ") refills the slot before C(" << b - ring << ")";
        }
        if (b + ring < m_blocks) {
          // Dispatch runs as far ahead as the ring allows: D(b + R) right after C(b).
          EXPECT_EQ(pulled[b + ring], pushed[b] + 1);
        }
      }
    }
}

}  // namespace
}  // namespace pounce::moe
