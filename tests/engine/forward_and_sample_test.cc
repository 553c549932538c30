// Engine::ForwardAndSample on the CPU engine: the sampler applied to Forward's last-token logits.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/engine/cpu_engine.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

class ForwardAndSampleTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = LoadModel(testing::TestDataPath("golden/tiny-linear-m"));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *model;
    golden_ = testing::LoadGolden("tiny-linear-m");
  }
  std::shared_ptr<const Model> model_;
  testing::Golden golden_;
};

TEST_F(ForwardAndSampleTest, GreedyReproducesTheReference) {
  CpuEngine engine(model_);
  std::vector<SequenceChunk> batch;
  for (int64_t b = 0; b < golden_.batch; ++b) {
    batch.push_back({*engine.CreateSequence(), golden_.input_ids[b]});
  }
  const std::vector<SamplingParams> greedy(golden_.batch);
  std::vector<SampledToken> sampled;
  std::vector<std::vector<int32_t>> generated(golden_.batch);
  for (int64_t g = 0; g < golden_.greedy_steps; ++g) {
    ASSERT_TRUE(engine.ForwardAndSample(batch, greedy, &sampled).ok());
    for (int64_t b = 0; b < golden_.batch; ++b) {
      generated[b].push_back(sampled[b].id);
      batch[b].tokens = std::span(&generated[b].back(), 1);
      EXPECT_LT(sampled[b].logprob, 0.0f);
    }
  }
  EXPECT_EQ(generated, golden_.greedy_ids);
}

TEST_F(ForwardAndSampleTest, SeededDrawsAreTheSamplersDraws) {
  CpuEngine engine(model_);
  const SequenceSlot slot = *engine.CreateSequence();
  const SequenceChunk chunk{slot, golden_.input_ids[0]};
  const SamplingParams params{.temperature = 1.0f, .top_p = 0.9f, .seed = 11};
  std::vector<SampledToken> sampled;
  ASSERT_TRUE(engine.ForwardAndSample({&chunk, 1}, {&params, 1}, &sampled).ok());

  CpuEngine reference(model_);
  const SequenceChunk again{*reference.CreateSequence(), golden_.input_ids[0]};
  std::vector<float> logits;
  ASSERT_TRUE(reference.Forward({&again, 1}, LogitsFor::kLastToken, &logits).ok());
  // The draw counter is the sequence's length after the chunk.
  EXPECT_EQ(sampled[0].id, SampleToken(logits, params, {}, {}, golden_.length).id);
}

TEST_F(ForwardAndSampleTest, BadSamplingIsRefusedBeforeAnyStateChanges) {
  CpuEngine engine(model_);
  const SequenceSlot slot = *engine.CreateSequence();
  const SequenceChunk chunk{slot, golden_.input_ids[0]};
  std::vector<SampledToken> sampled;
  const SamplingParams penalty{.repetition_penalty = 1.2f}, hot{.temperature = -1.0f};
  absl::Status status = engine.ForwardAndSample({&chunk, 1}, {&penalty, 1}, &sampled);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("sampling[0]"));
  status = engine.ForwardAndSample({&chunk, 1}, {&hot, 1}, &sampled);
  EXPECT_THAT(std::string(status.message()), HasSubstr("sampling[0].temperature"));
  status = engine.ForwardAndSample({&chunk, 1}, {}, &sampled);
  EXPECT_THAT(std::string(status.message()), HasSubstr("sampling: 0 entries for a batch of 1"));
  EXPECT_EQ(*engine.SequenceLength(slot), 0);
}

TEST_F(ForwardAndSampleTest, StartAndFinishAreForwardAndSampleInTwoHalves) {
  CpuEngine engine(model_), reference(model_);
  const SequenceChunk chunk{*engine.CreateSequence(), golden_.input_ids[0]};
  const SequenceChunk same{*reference.CreateSequence(), golden_.input_ids[0]};
  const SamplingParams params{.temperature = 0.8f, .seed = 5};
  std::vector<SampledToken> expected, sampled;
  ASSERT_TRUE(reference.ForwardAndSample({&same, 1}, {&params, 1}, &expected).ok());

  EXPECT_EQ(engine.FinishForwardAndSample(&sampled).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(engine.StartForwardAndSample({&chunk, 1}, {&params, 1}).ok());
  EXPECT_EQ(*engine.SequenceLength(chunk.slot), golden_.length);
  // While a step is in flight, only a Start that queues behind it may come, up to the limit.
  std::vector<float> logits;
  EXPECT_EQ(engine.Forward({&chunk, 1}, LogitsFor::kLastToken, &logits).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(engine.ForwardAndSample({&chunk, 1}, {&params, 1}, &sampled).code(),
            absl::StatusCode::kFailedPrecondition);
  const SequenceChunk next{.slot = chunk.slot, .tokens = {}, .takes_token_in_flight = true};
  ASSERT_TRUE(engine.StartForwardAndSample({&next, 1}, {&params, 1}).ok());
  static_assert(Engine::kMaxStepsInFlight == 2);
  EXPECT_EQ(engine.StartForwardAndSample({&next, 1}, {&params, 1}).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*engine.SequenceLength(chunk.slot), golden_.length + 1);

  // Finish hands over the oldest step first.
  ASSERT_TRUE(engine.FinishForwardAndSample(&sampled).ok());
  ASSERT_EQ(sampled.size(), 1u);
  EXPECT_EQ(sampled[0].id, expected[0].id);
  EXPECT_EQ(sampled[0].logprob, expected[0].logprob);
  const SequenceChunk fed_back{same.slot, std::span(&expected[0].id, 1)};
  ASSERT_TRUE(reference.ForwardAndSample({&fed_back, 1}, {&params, 1}, &expected).ok());
  ASSERT_TRUE(engine.FinishForwardAndSample(&sampled).ok());
  EXPECT_EQ(sampled[0].id, expected[0].id);
  EXPECT_EQ(sampled[0].logprob, expected[0].logprob);
  EXPECT_EQ(engine.FinishForwardAndSample(&sampled).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(*engine.SequenceLength(chunk.slot), golden_.length + 1);
}

// A step queued behind the one in flight, its chunks taking that step's tokens, computes what
// feeding those tokens back from the host computes.
TEST_F(ForwardAndSampleTest, StepsQueuedBehindTheOneInFlightTakeItsTokens) {
  for (const SamplingParams& sampling :
       {SamplingParams{}, SamplingParams{.temperature = 0.9f, .top_p = 0.95f}}) {
    CpuEngine pipelined(model_), one_at_a_time(model_);
    const auto expected = testing::GenerateScripted(one_at_a_time, false, 20, sampling);
    const auto got = testing::GenerateScripted(pipelined, true, 20, sampling);
    ASSERT_EQ(got.size(), expected.size());
    for (size_t step = 0; step < got.size(); ++step) {
      ASSERT_EQ(got[step].size(), expected[step].size());
      for (size_t b = 0; b < got[step].size(); ++b) {
        EXPECT_EQ(got[step][b].id, expected[step][b].id) << "step " << step << " row " << b;
        EXPECT_EQ(got[step][b].logprob, expected[step][b].logprob);
      }
    }
  }
}

TEST_F(ForwardAndSampleTest, TakingATokenNotInFlightIsRefused) {
  CpuEngine engine(model_);
  const SequenceSlot a = *engine.CreateSequence(), b = *engine.CreateSequence();
  const SamplingParams params;
  const SequenceChunk takes{.slot = a, .tokens = {}, .takes_token_in_flight = true};
  absl::Status status = engine.StartForwardAndSample({&takes, 1}, {&params, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("batch[0].takes_token_in_flight"));

  const SequenceChunk prompt{a, golden_.input_ids[0]};
  ASSERT_TRUE(engine.StartForwardAndSample({&prompt, 1}, {&params, 1}).ok());
  const SequenceChunk other{.slot = b, .tokens = {}, .takes_token_in_flight = true};
  status = engine.StartForwardAndSample({&other, 1}, {&params, 1});
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("batch[0].takes_token_in_flight: no step in flight chooses a token for "
                        "slot 1"));
  const SequenceChunk both{.slot = a, .tokens = prompt.tokens, .takes_token_in_flight = true};
  status = engine.StartForwardAndSample({&both, 1}, {&params, 1});
  EXPECT_THAT(std::string(status.message()), HasSubstr("batch[0].tokens: must be empty"));
  std::vector<SampledToken> sampled;
  ASSERT_TRUE(engine.FinishForwardAndSample(&sampled).ok());
  std::vector<float> logits;
  status = engine.Forward({&takes, 1}, LogitsFor::kLastToken, &logits);
  EXPECT_THAT(std::string(status.message()), HasSubstr("batch[0].takes_token_in_flight"));
  EXPECT_EQ(*engine.SequenceLength(a), golden_.length);
  EXPECT_EQ(*engine.SequenceLength(b), 0);
}

}  // namespace
}  // namespace ttt
