#include "server/scheduler/delivery_thread.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ttt {
namespace {

TEST(DeliveryThreadTest, RunsEveryDeliveryInTheOrderPosted) {
  std::vector<int> seen;  // Touched by the delivery thread only, read after it stopped.
  {
    DeliveryThread delivery;
    int next = 0;
    for (int batch = 0; batch < 200; ++batch) {
      std::vector<DeliveryThread::Delivery> deliveries;
      for (int i = 0; i < batch % 7; ++i) {
        deliveries.push_back([&seen, value = next++] { seen.push_back(value); });
      }
      delivery.Post(std::move(deliveries));
    }
  }  // The destructor runs what is still queued.
  ASSERT_EQ(seen.size(), 594u);  // Σ_{b<200} (b mod 7).
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], static_cast<int>(i));
}

TEST(DeliveryThreadTest, RunsOffThePostingThread) {
  std::atomic<bool> ran_elsewhere{false};
  const std::thread::id poster = std::this_thread::get_id();
  {
    DeliveryThread delivery;
    delivery.Post({[&] { ran_elsewhere = std::this_thread::get_id() != poster; }});
  }
  EXPECT_TRUE(ran_elsewhere);
}

}  // namespace
}  // namespace ttt
