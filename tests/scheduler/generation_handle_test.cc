// What a generation's caller is woken for (GenerationHandle::Next): enough tokens, the end, or a
// token that has waited its time. The scheduler runs the tiny golden model's CPU engine.
#include <gtest/gtest.h>

#include <memory>

#include "server/engine/cpu_engine.h"
#include "server/model/model.h"
#include "server/scheduler/scheduler.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

std::unique_ptr<Scheduler> StartScheduler() {
  absl::StatusOr<std::shared_ptr<const Model>> model =
      LoadModel(testing::TestDataPath("golden/tiny-linear-m"));
  EXPECT_TRUE(model.ok()) << model.status();
  return std::make_unique<Scheduler>(std::make_unique<CpuEngine>(*model), SchedulerOptions{});
}

GenerationSpec Greedy(int32_t tokens) {
  GenerationSpec spec;
  spec.prompt = {1, 15, 27};
  spec.stop.max_new_tokens = tokens;
  spec.stop.ignore_eos = true;
  return spec;
}

TEST(GenerationHandleTest, WakesForEnoughTokensOrTheEnd) {
  std::unique_ptr<Scheduler> scheduler = StartScheduler();
  constexpr int32_t kTokens = 300;
  constexpr size_t kBatch = 64;
  std::shared_ptr<GenerationHandle> handle = *scheduler->Submit(Greedy(kTokens));
  size_t received = 0;
  GenerationUpdate update;
  do {
    ASSERT_TRUE(handle->Next(absl::Seconds(60), &update, kBatch));
    received += update.tokens.size();
    if (!update.finished) {
      EXPECT_GE(update.tokens.size(), kBatch);
    }
  } while (!update.finished);
  EXPECT_EQ(received, static_cast<size_t>(kTokens));
}

TEST(GenerationHandleTest, AHeldTokenGoesOnceItHasWaitedItsTime) {
  std::unique_ptr<Scheduler> scheduler = StartScheduler();
  // Far more tokens than the engine makes in the hold (a step takes microseconds, not less).
  std::shared_ptr<GenerationHandle> handle = *scheduler->Submit(Greedy(20'000));
  GenerationUpdate update;
  ASSERT_TRUE(handle->Next(absl::Seconds(60), &update, /*min_tokens=*/1'000'000,
                           /*max_hold=*/absl::Milliseconds(1)));
  EXPECT_FALSE(update.finished);
  EXPECT_GE(update.tokens.size(), 1u);
  handle->Cancel(FinishReason::kCancelled);
  do {
    ASSERT_TRUE(handle->Next(absl::Seconds(60), &update));
  } while (!update.finished);
}

}  // namespace
}  // namespace ttt
