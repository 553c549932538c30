// The GPU sampler against the CPU sampler: on rows a broken model could produce (NaN and −∞
// logits) every id it returns is a token of the vocabulary, so the next step's embedding lookup
// stays inside the table; with top-k, top-p and min-p it keeps the same tokens and draws the same
// one. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "kernels/cuda_device.h"
#include "kernels/cuda_ops.h"
#include "server/engine/sampler.h"
#include "tests/gpu/device_array.h"

namespace ttt {
namespace {

namespace cu = kernels::cuda;
using testing::DeviceArray;

TEST(CudaSamplerTest, RowsWithoutAFiniteLogitStillYieldATokenOfTheVocabulary) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  constexpr int kVocab = 300;
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // Rows: NaN throughout, −∞ throughout, and finite logits (largest at 123) with NaNs among them.
  std::vector<std::vector<float>> rows = {std::vector<float>(kVocab, kNaN),
                                          std::vector<float>(kVocab, -kInf),
                                          std::vector<float>(kVocab)};
  for (int i = 0; i < kVocab; ++i) rows[2][i] = i % 7 == 0 ? kNaN : std::sin(0.1f * i);
  rows[2][123] = 5.0f;
  const std::vector<cu::SamplingRow> params = {
      {.temperature = 0.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 1, .step = 0},
      {.temperature = 1.0f, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f, .seed = 2, .step = 3},
      {.temperature = 0.8f, .top_k = 40, .top_p = 0.9f, .min_p = 0.05f, .seed = 3, .step = 7}};
  for (const cu::SamplingRow& p : params) {
    std::vector<float> logits;
    std::vector<cu::SamplingRow> per_row;
    for (const std::vector<float>& row : rows) {
      logits.insert(logits.end(), row.begin(), row.end());
      per_row.push_back(p);
    }
    DeviceArray<float> device_logits(logits);
    DeviceArray<cu::SamplingRow> device_params(per_row);
    DeviceArray<int32_t> ids(std::vector<int32_t>(rows.size(), -1));
    DeviceArray<float> logprobs(std::vector<float>(rows.size()));
    ASSERT_EQ(cu::SampleTokens(device_logits.get(), static_cast<int>(rows.size()), kVocab,
                               device_params.get(), ids.get(), logprobs.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "temperature " << p.temperature;
    const std::vector<int32_t> chosen = ids.ToHost();
    for (size_t r = 0; r < rows.size(); ++r) {
      const SampledToken on_cpu = SampleToken(rows[r],
                                              {.temperature = p.temperature,
                                               .top_k = p.top_k,
                                               .top_p = p.top_p,
                                               .min_p = p.min_p,
                                               .seed = p.seed},
                                              {}, {}, p.step);
      EXPECT_GE(chosen[r], 0) << "row " << r << ", temperature " << p.temperature;
      EXPECT_LT(chosen[r], kVocab) << "row " << r << ", temperature " << p.temperature;
      if (r < 2) {
        EXPECT_EQ(chosen[r], 0) << "row " << r << ", temperature " << p.temperature;
        EXPECT_EQ(on_cpu.id, 0) << "row " << r << ", temperature " << p.temperature;
      }
    }
    if (p.temperature == 0.0f) {
      EXPECT_EQ(chosen[2], 123);
    }
  }
}

// Draws `kSteps` tokens from each of the rows of `logits` [rows, vocab] with each of `settings`,
// on the GPU and by the CPU sampler with the same seed and step: both keep the same tokens, so
// both draw the same token (a kept set off by one token moves most draws). A setting may differ
// in one draw of all: their masses are summed in other orders and precisions.
void ExpectTheCpuSamplersDraws(const std::vector<float>& logits, int vocab,
                               const std::vector<SamplingParams>& settings) {
  constexpr int kSteps = 6;
  const int rows = static_cast<int>(logits.size() / vocab);
  const DeviceArray<float> device_logits(logits);
  for (size_t setting = 0; setting < settings.size(); ++setting) {
    const SamplingParams& params = settings[setting];
    int same = 0, draws = 0;
    for (uint64_t step = 0; step < kSteps; ++step) {
      std::vector<cu::SamplingRow> params_by_row;
      for (int r = 0; r < rows; ++r) {
        params_by_row.push_back({.temperature = params.temperature,
                                 .top_k = params.top_k,
                                 .top_p = params.top_p,
                                 .min_p = params.min_p,
                                 .seed = 1000 * setting + r,
                                 .step = step});
      }
      const DeviceArray<cu::SamplingRow> device_params(params_by_row);
      DeviceArray<int32_t> ids{std::vector<int32_t>(rows, -1)};
      DeviceArray<float> logprobs{std::vector<float>(rows)};
      ASSERT_EQ(cu::SampleTokens(device_logits.get(), rows, vocab, device_params.get(), ids.get(),
                                 logprobs.get(), nullptr),
                cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<int32_t> chosen = ids.ToHost();
      for (int r = 0; r < rows; ++r) {
        const std::span<const float> row(&logits[static_cast<size_t>(r) * vocab], vocab);
        SamplingParams seeded = params;
        seeded.seed = params_by_row[r].seed;
        same += chosen[r] == SampleToken(row, seeded, {}, {}, step).id;
        ++draws;
        if (params.top_k > 0) {
          // Ranked as both samplers rank: by the tempered score.
          const float top = *std::max_element(row.begin(), row.end());
          auto score = [&](float l) { return (l - top) * (1.0f / params.temperature); };
          const auto above = std::count_if(
              row.begin(), row.end(), [&](float l) { return score(l) > score(row[chosen[r]]); });
          EXPECT_LT(above, params.top_k) << "row " << r << ", step " << step;
        }
      }
    }
    std::printf("[cuda-sampling] setting %zu: the CPU sampler's token in %d of %d draws\n", setting,
                same, draws);
    EXPECT_GE(same, draws - 1) << "setting " << setting;
  }
}

// Top-k, top-p and min-p over rows as wide as a real vocabulary, flat to peaked, their logits
// distinct. The last rows have one token far above a crowded tail, as a trained model's often do,
// where top-k's threshold lies among the crowd. Top-k 50 draws from the tokens its search
// gathered; top-k 400, where it gathers, keeps more than that draw takes and walks the row.
TEST(CudaSamplerTest, TruncatedDrawsMatchTheCpuSampler) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  constexpr int kVocab = 32000, kFlatRows = 48, kRows = 64;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> logits(static_cast<size_t>(kRows) * kVocab);
  for (int r = 0; r < kRows; ++r) {
    const float spread = r < kFlatRows ? 0.25f * static_cast<float>(1 + r % 12) : 1.0f;
    for (int i = 0; i < kVocab; ++i)
      logits[static_cast<size_t>(r) * kVocab + i] = spread * normal(rng);
    if (r >= kFlatRows) logits[static_cast<size_t>(r) * kVocab + (997 * r) % kVocab] += 15.0f;
  }
  ExpectTheCpuSamplersDraws(logits, kVocab,
                            {{.temperature = 1.0f, .top_k = 50},
                             {.temperature = 1.0f, .top_k = 50, .top_p = 0.95f},
                             {.temperature = 0.8f, .top_k = 5},
                             {.temperature = 1.0f, .top_k = 400},
                             {.temperature = 0.7f, .top_p = 0.9f},
                             {.temperature = 1.3f, .top_p = 0.5f},
                             {.temperature = 1.0f, .min_p = 0.05f},
                             {.temperature = 0.9f, .top_k = 2000, .top_p = 0.95f, .min_p = 0.01f},
                             {.temperature = 1.0f, .top_p = 0.8f, .min_p = 0.2f},
                             {.temperature = 1.0f, .top_k = kVocab - 1}});
}

// Vocabularies of other sizes take other paths: GPT-2's 50,257 tokens are no whole number of
// 16-byte loads, and from 65,536 tokens on top-k's first digit is 8 bits, its counts unpacked
// (Llama 3's 128,256).
TEST(CudaSamplerTest, OtherVocabularySizesMatchTheCpuSampler) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  for (const int vocab : {50257, 128256}) {
    SCOPED_TRACE(vocab);
    constexpr int kRows = 16;
    std::mt19937 rng(vocab);
    std::normal_distribution<float> normal;
    std::vector<float> logits(static_cast<size_t>(kRows) * vocab);
    for (int r = 0; r < kRows; ++r) {
      for (int i = 0; i < vocab; ++i) logits[static_cast<size_t>(r) * vocab + i] = normal(rng);
      if (r % 2 == 1) logits[static_cast<size_t>(r) * vocab + (7919 * r) % vocab] += 15.0f;
    }
    ExpectTheCpuSamplersDraws(logits, vocab,
                              {{.temperature = 1.0f, .top_k = 50},
                               {.temperature = 1.0f, .top_k = 50, .top_p = 0.95f},
                               {.temperature = 0.7f, .top_p = 0.9f},
                               {.temperature = 1.0f, .top_k = 2000, .min_p = 0.01f}});
  }
}

// Logits on a grid of 1/8, so that every threshold falls among tokens of one value: both samplers
// keep each token tied with the last one a threshold keeps, whatever its id.
TEST(CudaSamplerTest, ThresholdsKeepTiedTokensWholeAsTheCpuSamplerDoes) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  constexpr int kVocab = 32000, kRows = 16;
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  std::vector<float> logits(static_cast<size_t>(kRows) * kVocab);
  for (float& l : logits) l = std::round(8.0f * normal(rng)) / 8.0f;
  ExpectTheCpuSamplersDraws(logits, kVocab,
                            {{.temperature = 1.0f, .top_k = 50},
                             {.temperature = 1.2f, .top_k = 200},
                             {.temperature = 0.8f, .top_p = 0.9f},
                             {.temperature = 1.0f, .top_k = 50, .top_p = 0.95f}});
}

// Both samplers rank by the tempered score in float: at temperature 10 the logits −3 and the float
// just below it, 13 under the top, round to one score, so top-k 2 keeps both tied tokens on
// either backend (the CPU sampler had ranked by the logit and kept one).
TEST(CudaSamplerTest, TopKRanksByTemperedScoresAsTheCpuSamplerDoes) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  constexpr int kVocab = 1000, kRows = 16;
  const float second = -3.0f, third = std::nextafter(second, -INFINITY);
  ASSERT_EQ((second - 10.0f) * (1.0f / 10.0f), (third - 10.0f) * (1.0f / 10.0f));
  std::vector<float> logits(static_cast<size_t>(kRows) * kVocab);
  for (int r = 0; r < kRows; ++r) {
    float* row = &logits[static_cast<size_t>(r) * kVocab];
    for (int i = 0; i < kVocab; ++i) row[i] = -50.0f - 0.001f * static_cast<float>(i);
    row[(37 * r + 5) % kVocab] = 10.0f;
    row[(91 * r + 500) % kVocab] = second;
    row[(53 * r + 250) % kVocab] = third;
  }
  ExpectTheCpuSamplersDraws(
      logits, kVocab,
      {{.temperature = 10.0f, .top_k = 2}, {.temperature = 10.0f, .top_k = 2, .top_p = 0.99f}});
}

}  // namespace
}  // namespace ttt
