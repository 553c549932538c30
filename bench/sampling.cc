// How long the GPU sampler takes for a step's rows of logits, by sampling setting and by how
// peaked the rows are: rows of N(0, spread²) logits, in the last kind with one token a row raised
// by `peak` so that it holds most of the row's mass, as in a confident model's rows. Each setting
// is launched 50 times on the same rows (the median; the rows stay in L2 between launches, as the
// LM head leaves them for the sampler in a step).
// Prints one JSON line per (kind of row, setting).
//   ttt-sampling [ROWS [VOCAB]]   (default 256 rows of 32,000)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "kernels/cuda_ops.h"
#include "server/util/percentile.h"

namespace {

namespace cu = ttt::kernels::cuda;
using ttt::Median;

struct Setting {
  const char* name;
  float temperature;
  int32_t top_k;
  float top_p, min_p;
};

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? std::atoi(argv[1]) : 256;
  const int vocab = argc > 2 ? std::atoi(argv[2]) : 32000;
  constexpr int kLaunches = 50;
  const std::vector<Setting> settings = {{"greedy", 0, 0, 1, 0},
                                         {"temperature 1", 1, 0, 1, 0},
                                         {"top-k 50", 1, 50, 1, 0},
                                         {"top-k 5000", 1, 5000, 1, 0},
                                         {"top-p 0.9", 1, 0, 0.9f, 0},
                                         {"top-p 0.5", 1, 0, 0.5f, 0},
                                         {"min-p 0.05", 1, 0, 1, 0.05f},
                                         {"top-k 50, top-p 0.95", 1, 50, 0.95f, 0},
                                         {"top-k 50, top-p 0.95, min-p 0.05", 1, 50, 0.95f, 0.05f}};
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> logits(static_cast<size_t>(rows) * vocab);
  float *device_logits = nullptr, *logprobs = nullptr;
  cu::SamplingRow* params = nullptr;
  int32_t* ids = nullptr;
  CHECK_CUDA(cudaMalloc(&device_logits, logits.size() * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&params, rows * sizeof(cu::SamplingRow)));
  CHECK_CUDA(cudaMalloc(&ids, rows * sizeof(int32_t)));
  CHECK_CUDA(cudaMalloc(&logprobs, rows * sizeof(float)));
  EventTimer timer;
  struct Rows {
    float spread, peak;
  };
  for (const Rows kind : {Rows{0.05f, 0}, Rows{1, 0}, Rows{3, 0}, Rows{1, 15}}) {
    for (float& l : logits) l = kind.spread * normal(rng);
    for (int r = 0; r < rows; ++r)
      logits[static_cast<size_t>(r) * vocab + r * 7919 % vocab] += kind.peak;
    CHECK_CUDA(cudaMemcpy(device_logits, logits.data(), logits.size() * sizeof(float),
                          cudaMemcpyHostToDevice));
    for (const Setting& setting : settings) {
      std::vector<cu::SamplingRow> per_row;
      for (int r = 0; r < rows; ++r) {
        per_row.push_back({.temperature = setting.temperature,
                           .top_k = setting.top_k,
                           .top_p = setting.top_p,
                           .min_p = setting.min_p,
                           .seed = static_cast<uint64_t>(r),
                           .step = 0});
      }
      CHECK_CUDA(cudaMemcpy(params, per_row.data(), rows * sizeof(cu::SamplingRow),
                            cudaMemcpyHostToDevice));
      std::vector<float> us;
      for (int launch = 0; launch < kLaunches; ++launch) {
        us.push_back(1e3f * timer.Ms([&] {
          CHECK_CUDA(cu::SampleTokens(device_logits, rows, vocab, params, ids, logprobs, nullptr));
        }));
      }
      std::printf(
          "{\"rows\": %d, \"vocab\": %d, \"spread\": %g, \"peak\": %g, \"setting\": \"%s\", "
          "\"us_p50\": %.2f}\n",
          rows, vocab, kind.spread, kind.peak, setting.name, Median(us));
    }
  }
  cudaFree(device_logits);
  cudaFree(params);
  cudaFree(ids);
  cudaFree(logprobs);
  return 0;
}
