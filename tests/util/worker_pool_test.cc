#include "server/util/worker_pool.h"

#include <atomic>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ttt {
namespace {

TEST(WorkerPoolTest, OneThreadRunsEveryTaskInTheOrderPosted) {
  std::vector<int> seen;  // Touched by the pool's thread only, read after it stopped.
  {
    WorkerPool pool(1, "test");
    for (int i = 0; i < 1000; ++i) pool.Post([&seen, i] { seen.push_back(i); });
  }  // The destructor runs what is still queued.
  ASSERT_EQ(seen.size(), 1000u);
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], static_cast<int>(i));
}

TEST(WorkerPoolTest, RunsOffThePostingThread) {
  std::atomic<bool> ran_elsewhere{false};
  const std::thread::id poster = std::this_thread::get_id();
  {
    WorkerPool pool(1, "test");
    pool.Post([&] { ran_elsewhere = std::this_thread::get_id() != poster; });
  }
  EXPECT_TRUE(ran_elsewhere);
}

TEST(WorkerPoolTest, SeveralThreadsRunEveryTaskOnce) {
  constexpr int kTasks = 10000;
  std::vector<std::atomic<int>> runs(kTasks);
  {
    WorkerPool pool(4, "test");
    for (int i = 0; i < kTasks; ++i) pool.Post([&runs, i] { ++runs[i]; });
  }
  for (int i = 0; i < kTasks; ++i) ASSERT_EQ(runs[i], 1) << "task " << i;
}

}  // namespace
}  // namespace ttt
