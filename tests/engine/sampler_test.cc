#include <cmath>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "server/engine/sampler.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

std::vector<float> LogitsOf(std::vector<double> probs) {
  std::vector<float> logits;
  for (double p : probs) logits.push_back(static_cast<float>(std::log(p)));
  return logits;
}

// How often each token is drawn in `draws` steps.
std::vector<double> Frequencies(const std::vector<float>& logits, const SamplingParams& params,
                                int draws) {
  std::vector<double> counts(logits.size(), 0);
  for (int step = 0; step < draws; ++step) {
    counts[SampleToken(logits, params, {}, {}, step).id] += 1.0 / draws;
  }
  return counts;
}

TEST(SamplerTest, GreedyIsArgmaxWithItsLogprob) {
  const std::vector<float> logits = {0.5f, 3.0f, -1.0f, 2.9f};
  const SampledToken token = SampleToken(logits, {}, {}, {}, 0);
  EXPECT_EQ(token.id, 1);
  double sum = 0;
  for (float l : logits) sum += std::exp(l);
  EXPECT_NEAR(token.logprob, 3.0 - std::log(sum), 1e-5);
}

TEST(SamplerTest, DrawsFollowTheDistribution) {
  const auto freq = Frequencies(LogitsOf({0.5, 0.3, 0.2}), {.temperature = 1.0f}, 20000);
  EXPECT_NEAR(freq[0], 0.5, 0.015);
  EXPECT_NEAR(freq[1], 0.3, 0.015);
  EXPECT_NEAR(freq[2], 0.2, 0.015);
}

TEST(SamplerTest, TemperatureSharpens) {
  const auto freq = Frequencies(LogitsOf({0.5, 0.3, 0.2}), {.temperature = 0.25f}, 20000);
  // p ∝ p_i^4: 0.0625, 0.0081, 0.0016 → 0.866, 0.112, 0.022.
  EXPECT_NEAR(freq[0], 0.866, 0.015);
  EXPECT_NEAR(freq[2], 0.022, 0.01);
}

TEST(SamplerTest, TopKTopPAndMinPCutTheTail) {
  const std::vector<float> logits = LogitsOf({0.4, 0.25, 0.2, 0.1, 0.05});
  auto top_k = Frequencies(logits, {.temperature = 1.0f, .top_k = 2}, 4000);
  EXPECT_EQ(top_k[2] + top_k[3] + top_k[4], 0.0);
  EXPECT_NEAR(top_k[0], 0.4 / 0.65, 0.03);
  auto top_p = Frequencies(logits, {.temperature = 1.0f, .top_p = 0.6f}, 4000);
  EXPECT_EQ(top_p[2] + top_p[3] + top_p[4], 0.0);  // 0.4 + 0.25 reaches 0.6.
  EXPECT_GT(top_p[1], 0.0);
  auto min_p = Frequencies(logits, {.temperature = 1.0f, .min_p = 0.3f}, 4000);
  EXPECT_EQ(min_p[3] + min_p[4], 0.0);  // Below 0.3 × 0.4 = 0.12.
  EXPECT_GT(min_p[2], 0.0);
}

TEST(SamplerTest, ThresholdsKeepTiedTokensWhole) {
  // Tokens 1, 2 and 3 tie. Top-k 2 keeps all three; the nucleus of 0.5 reaches it at token 1
  // (0.4 + 0.2 of 1.1) and keeps its ties. Which of equal tokens stay never depends on their ids.
  const std::vector<float> logits = LogitsOf({0.4, 0.2, 0.2, 0.2, 0.1});
  for (const SamplingParams& params : {SamplingParams{.temperature = 1.0f, .top_k = 2},
                                       SamplingParams{.temperature = 1.0f, .top_p = 0.5f}}) {
    const auto freq = Frequencies(logits, params, 4000);
    EXPECT_EQ(freq[4], 0.0) << "top_k " << params.top_k << ", top_p " << params.top_p;
    for (int id = 1; id <= 3; ++id) {
      EXPECT_NEAR(freq[id], 0.2, 0.03) << "token " << id << ", top_k " << params.top_k;
    }
  }
}

TEST(SamplerTest, ThresholdsRankByTemperedScores) {
  // At temperature 10, −3 and the float just below it lie 13 under the top, where their tempered
  // scores round to one value: top-k 2 keeps both, as the GPU sampler, which ranks by that
  // score, does. Token 3 is last by its logit.
  const std::vector<float> logits = {10.0f, -3.0f, -50.0f, std::nextafter(-3.0f, -50.0f)};
  const auto freq = Frequencies(logits, {.temperature = 10.0f, .top_k = 2}, 4000);
  EXPECT_GT(freq[3], 0.1);
  EXPECT_EQ(freq[2], 0.0);
}

TEST(SamplerTest, SameSeedSameTokensOtherSeedOtherTokens) {
  const std::vector<float> logits(50, 0.0f);
  std::vector<int32_t> a, b, c;
  for (int step = 0; step < 64; ++step) {
    a.push_back(SampleToken(logits, {.temperature = 1.0f, .seed = 7}, {}, {}, step).id);
    b.push_back(SampleToken(logits, {.temperature = 1.0f, .seed = 7}, {}, {}, step).id);
    c.push_back(SampleToken(logits, {.temperature = 1.0f, .seed = 8}, {}, {}, step).id);
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(SamplerTest, PenaltiesDiscourageSeenTokens) {
  const std::vector<float> logits = {2.0f, 1.9f, -1.0f, -1.05f};
  const std::vector<int32_t> prompt = {0};
  EXPECT_EQ(SampleToken(logits, {}, prompt, {}, 0).id, 0);
  // Positive logits are divided, negative ones multiplied.
  EXPECT_EQ(SampleToken(logits, {.repetition_penalty = 1.2f}, prompt, {}, 0).id, 1);
  const std::vector<float> negative = {-1.0f, -1.05f};
  EXPECT_EQ(SampleToken(negative, {.repetition_penalty = 1.2f}, std::vector<int32_t>{0}, {}, 0).id,
            1);
  // Presence and frequency count only output tokens.
  EXPECT_EQ(SampleToken(logits, {.presence_penalty = 0.2f}, prompt, {}, 0).id, 0);
  EXPECT_EQ(SampleToken(logits, {.presence_penalty = 0.2f}, {}, std::vector<int32_t>{0}, 0).id, 1);
  EXPECT_EQ(SampleToken(logits, {.frequency_penalty = 0.06f}, {}, std::vector<int32_t>{0, 0}, 0).id,
            1);
  EXPECT_EQ(SampleToken(logits, {.frequency_penalty = 0.06f}, {}, std::vector<int32_t>{0}, 0).id,
            0);
}

// A broken model's NaN logits are never chosen over a number, and a row of nothing but NaN
// still yields a token of the vocabulary (id 0), whatever the parameters.
TEST(SamplerTest, NaNLogitsAreNeverChosenOverNumbers) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = i % 3 == 0 ? NAN : 0.1f * (i % 11);
  logits[17] = 4.0f;
  const std::vector<float> all_nan(50, NAN);
  for (const SamplingParams& p :
       {SamplingParams{}, SamplingParams{.temperature = 1.0f, .seed = 3},
        SamplingParams{.temperature = 0.7f, .top_k = 5, .top_p = 0.8f, .min_p = 0.1f, .seed = 4}}) {
    for (uint64_t step = 0; step < 20; ++step) {
      const int32_t id = SampleToken(logits, p, {}, {}, step).id;
      EXPECT_TRUE(id >= 0 && id < 50 && id % 3 != 0) << id;
      EXPECT_EQ(SampleToken(all_nan, p, {}, {}, step).id, 0);
    }
  }
  EXPECT_EQ(SampleToken(logits, {}, {}, {}, 0).id, 17);
}

TEST(SamplerTest, InvalidParametersNameTheField) {
  auto message = [](const SamplingParams& p) {
    return std::string(ValidateSamplingParams(p).message());
  };
  EXPECT_TRUE(ValidateSamplingParams({}).ok());
  EXPECT_THAT(message({.temperature = -1.0f}), HasSubstr("temperature"));
  EXPECT_THAT(message({.temperature = NAN}), HasSubstr("temperature"));
  EXPECT_THAT(message({.top_k = -2}), HasSubstr("top_k"));
  EXPECT_THAT(message({.top_p = 0.0f}), HasSubstr("top_p"));
  EXPECT_THAT(message({.top_p = 1.5f}), HasSubstr("top_p"));
  EXPECT_THAT(message({.min_p = -0.1f}), HasSubstr("min_p"));
  EXPECT_THAT(message({.repetition_penalty = 0.0f}), HasSubstr("repetition_penalty"));
  EXPECT_THAT(message({.presence_penalty = INFINITY}), HasSubstr("presence_penalty"));
  EXPECT_THAT(message({.frequency_penalty = NAN}), HasSubstr("frequency_penalty"));
}

}  // namespace
}  // namespace ttt
