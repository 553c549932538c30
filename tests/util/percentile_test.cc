// Nearest-rank quantiles, as ttt-bench and ttt-loadgen report them and as the CUDA engine picks its
// batch-1 path by.
#include "server/util/percentile.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/time/time.h"

namespace ttt {
namespace {

TEST(PercentileTest, TakesTheValueAtTheRankOfTheSortedSample) {
  const std::vector<double> sample = {9, 1, 7, 3, 5, 2, 8, 4, 6, 10};
  EXPECT_EQ(Percentile(sample, 0.0), 1);
  EXPECT_EQ(Percentile(sample, 0.5), 6);  // Index 5 of 1..10.
  EXPECT_EQ(Percentile(sample, 0.9), 10);
  EXPECT_EQ(Percentile(sample, 0.99), 10);  // Index 9: never past the last.
  EXPECT_EQ(Percentile(sample, 1.0), 10);
}

TEST(PercentileTest, AnEmptySampleGivesZero) {
  EXPECT_EQ(Percentile(std::vector<double>{}, 0.5), 0);
  EXPECT_EQ(Median(std::vector<absl::Duration>{}), absl::ZeroDuration());
}

TEST(PercentileTest, TheMedianOfAnEvenCountIsTheUpperOfTheMiddleTwo) {
  EXPECT_EQ(Median(std::vector<float>{4, 1, 3, 2}), 3);
  EXPECT_EQ(Median(std::vector<int>{5, 1, 3}), 3);
}

TEST(PercentileTest, OrdersDurations) {
  const std::vector<absl::Duration> times = {absl::Microseconds(30), absl::Microseconds(10),
                                             absl::Microseconds(20)};
  EXPECT_EQ(Median(times), absl::Microseconds(20));
  EXPECT_EQ(Percentile(times, 0.0), absl::Microseconds(10));
}

}  // namespace
}  // namespace ttt
