// Bad Forward calls are refused with a message naming the field, and change no sequence.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/engine/cpu_engine.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

class ForwardInputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = LoadModel(testing::TestDataPath("golden/tiny-linear-t"));
    ASSERT_TRUE(model.ok()) << model.status();
    engine_ = std::make_unique<CpuEngine>(*model);
    good_ = *engine_->CreateSequence();
    ASSERT_TRUE(Forward({{good_, prefix_}}, LogitsFor::kNone).ok());
  }

  absl::Status Forward(std::vector<SequenceChunk> batch, LogitsFor which) {
    return engine_->Forward(batch, which, &logits_);
  }

  // The logits `good_` gives for `next` now; checks the sequence is where it was.
  std::vector<float> Probe() {
    const SequenceSlot fork = *engine_->ForkSequence(good_);
    std::vector<float> logits;
    EXPECT_TRUE(engine_->Forward(std::vector<SequenceChunk>{{fork, next_}}, LogitsFor::kLastToken,
                                 &logits)
                    .ok());
    EXPECT_TRUE(engine_->ReleaseSequence(fork).ok());
    return logits;
  }

  void ExpectRefused(std::vector<SequenceChunk> batch, LogitsFor which, absl::StatusCode code,
                     std::string_view field) {
    const std::vector<float> before = Probe();
    const absl::Status status = Forward(batch, which);
    EXPECT_EQ(status.code(), code) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(std::string(field)));
    EXPECT_EQ(*engine_->SequenceLength(good_), int64_t(prefix_.size()));
    EXPECT_EQ(Probe(), before) << "a refused call changed the state";
  }

  std::unique_ptr<CpuEngine> engine_;
  SequenceSlot good_ = -1;
  std::vector<int32_t> prefix_ = {5, 6, 7, 8, 9};
  std::vector<int32_t> next_ = {10, 11};
  std::vector<float> logits_;
};

TEST_F(ForwardInputTest, TokenAtOrAboveVocabSize) {
  const std::vector<int32_t> bad = {3, 512};
  ExpectRefused({{good_, next_}, {*engine_->CreateSequence(), bad}}, LogitsFor::kLastToken,
                absl::StatusCode::kInvalidArgument, "batch[1].tokens[1]");
}

TEST_F(ForwardInputTest, NegativeToken) {
  const std::vector<int32_t> bad = {-1};
  ExpectRefused({{good_, bad}}, LogitsFor::kEveryToken, absl::StatusCode::kInvalidArgument,
                "batch[0].tokens[0]");
}

TEST_F(ForwardInputTest, EmptyPromptWhenLogitsAreWanted) {
  ExpectRefused({{good_, {}}}, LogitsFor::kLastToken, absl::StatusCode::kInvalidArgument,
                "batch[0].tokens");
}

TEST_F(ForwardInputTest, EmptyChunkIsFineWithoutLogits) {
  const std::vector<float> before = Probe();
  EXPECT_TRUE(Forward({{good_, {}}}, LogitsFor::kEveryToken).ok());
  EXPECT_TRUE(logits_.empty());
  EXPECT_EQ(Probe(), before);
}

TEST_F(ForwardInputTest, SameSlotTwice) {
  ExpectRefused({{good_, next_}, {good_, next_}}, LogitsFor::kLastToken,
                absl::StatusCode::kInvalidArgument, "batch[1].slot");
}

TEST_F(ForwardInputTest, UnknownSlot) {
  ExpectRefused({{good_, next_}, {1234, next_}}, LogitsFor::kLastToken, absl::StatusCode::kNotFound,
                "batch[1].slot");
  ExpectRefused({{-1, next_}}, LogitsFor::kLastToken, absl::StatusCode::kNotFound, "batch[0].slot");
}

TEST_F(ForwardInputTest, LogitsShapes) {
  const SequenceSlot other = *engine_->CreateSequence();
  const std::vector<int32_t> three = {1, 2, 3};
  ASSERT_TRUE(Forward({{good_, next_}, {other, three}}, LogitsFor::kEveryToken).ok());
  EXPECT_EQ(logits_.size(), 5u * 512);
  ASSERT_TRUE(Forward({{good_, next_}, {other, three}}, LogitsFor::kLastToken).ok());
  EXPECT_EQ(logits_.size(), 2u * 512);
}

}  // namespace
}  // namespace ttt
