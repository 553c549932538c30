#include "server/engine/decode_order.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace ttt {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

std::vector<int32_t> Plan(const std::vector<DecodeWork>& work, int heads, int warps) {
  std::vector<int32_t> order(work.size());
  PlanDecodeOrder(work, heads, warps, order);
  return order;
}

// Each warp's work as the kernel deals the items out (position p to warp p mod warps), counting
// an item of a committing segment as two.
std::vector<int> WarpWork(const std::vector<DecodeWork>& work, const std::vector<int32_t>& order,
                          int heads, int warps) {
  std::vector<int> load(warps, 0);
  for (size_t s = 0; s < order.size(); ++s) {
    const DecodeWork w = work[order[s]];
    if (w == DecodeWork::kIdle) continue;
    for (int h = 0; h < heads; ++h) {
      load[(s * heads + h) % warps] += w == DecodeWork::kCommit ? 2 : 1;
    }
  }
  return load;
}

// A step of a server's batch: every sequence at its own offset, so one in 16 commits.
std::vector<DecodeWork> ServerStep(int segments, int live) {
  std::vector<DecodeWork> work(segments, DecodeWork::kIdle);
  for (int b = 0; b < live; ++b) work[b] = b % 16 == 5 ? DecodeWork::kCommit : DecodeWork::kToken;
  return work;
}

TEST(DecodeOrderTest, IsAPermutationWithIdleSegmentsLast) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> kind(0, 2);
  for (const int heads : {1, 12, 32}) {
    for (const int warps : {1, 100, 1716}) {
      for (const int segments : {1, 17, 256}) {
        std::vector<DecodeWork> work(segments);
        for (DecodeWork& w : work) w = static_cast<DecodeWork>(kind(rng));
        const std::vector<int32_t> order = Plan(work, heads, warps);
        std::vector<int32_t> sorted = order;
        std::sort(sorted.begin(), sorted.end());
        std::vector<int32_t> all(segments);
        std::iota(all.begin(), all.end(), 0);
        ASSERT_EQ(sorted, all) << heads << " heads, " << warps << " warps";
        const int live = static_cast<int>(std::count_if(
            work.begin(), work.end(), [](DecodeWork w) { return w != DecodeWork::kIdle; }));
        for (int s = 0; s < segments; ++s) {
          EXPECT_EQ(work[order[s]] == DecodeWork::kIdle, s >= live) << "place " << s;
        }
      }
    }
  }
}

TEST(DecodeOrderTest, CommitsGoWhereWarpsTakeAnItemFewer) {
  // 125m at batch 256: 12 heads, 3,072 items on the H200's 1,716 warps (13 an SM): 1,356 warps
  // take two items, 360 take one.
  const std::vector<DecodeWork> work = ServerStep(256, 256);
  const std::vector<int32_t> order = Plan(work, 12, 1716);
  const std::vector<int> load = WarpWork(work, order, 12, 1716);
  EXPECT_EQ(*std::max_element(load.begin(), load.end()), 2);
  // Dealt out in batch order, some committing items are a busier warp's second.
  std::vector<int32_t> batch_order(256);
  std::iota(batch_order.begin(), batch_order.end(), 0);
  const std::vector<int> unplanned = WarpWork(work, batch_order, 12, 1716);
  EXPECT_EQ(*std::max_element(unplanned.begin(), unplanned.end()), 3);
}

TEST(DecodeOrderTest, BucketPaddingCountsOnlyLiveItems) {
  // 245 sequences in the 256 bucket: 2,940 live items, so 1,224 warps take two.
  const std::vector<DecodeWork> work = ServerStep(256, 245);
  const std::vector<int32_t> order = Plan(work, 12, 1716);
  const std::vector<int> load = WarpWork(work, order, 12, 1716);
  EXPECT_EQ(*std::max_element(load.begin(), load.end()), 2);
}

TEST(DecodeOrderTest, CommitsBeyondTheLighterPlacesKeepBatchOrder) {
  // Every segment commits (every sequence at the same offset): nothing to gain, batch order
  // after the places filled first.
  const std::vector<DecodeWork> work(6, DecodeWork::kCommit);
  // 6 segments × 2 heads on 5 warps: warps 2–4 take two items, 0–1 three. Order indices 1
  // (positions 2, 3) and 4 (positions 8, 9: warps 3, 4) lie on the lighter warps alone.
  EXPECT_THAT(Plan(work, 2, 5), ElementsAre(2, 0, 3, 4, 1, 5));
}

TEST(DecodeOrderTest, BatchOrderWhereEveryWarpTakesTheSameItems) {
  const std::vector<DecodeWork> work = {DecodeWork::kToken, DecodeWork::kCommit, DecodeWork::kIdle,
                                        DecodeWork::kToken};
  // At most one item a warp (9 items, 16 warps), and exactly two a warp (8 on 4).
  EXPECT_THAT(Plan(work, 3, 16), ElementsAre(0, 1, 3, 2));
  EXPECT_THAT(Plan({DecodeWork::kToken, DecodeWork::kCommit}, 4, 4), ElementsAre(0, 1));
  EXPECT_THAT(Plan(std::vector<DecodeWork>(3, DecodeWork::kIdle), 2, 4),
              ElementsAreArray({0, 1, 2}));
}

}  // namespace
}  // namespace ttt
