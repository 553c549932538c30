// The GPU sampler on rows a broken model could produce (NaN and −∞ logits): every id it returns
// is a token of the vocabulary, as the CPU sampler's are, so the next step's embedding lookup
// stays inside the table. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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

}  // namespace
}  // namespace ttt
