// PostNormGate taking rows as the TTT decode kernel writes them (its `awaited` form): it waits for
// rows written after it has started, makes what the plain form makes from the same rows, makes an
// idle segment's row from zeros, and leaves every row pending again. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cuda_device.h"
#include "kernels/cuda_ops.h"
#include "tests/gpu/device_array.h"

namespace ttt {
namespace {

namespace cu = kernels::cuda;
using testing::DeviceArray;

std::vector<float> Random(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

uint32_t Bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

TEST(PostNormGateTest, AwaitedRowsAreMadeAsWrittenAndLeftPending) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  for (const int D : {2048, 200}) {
    SCOPED_TRACE(D);
    constexpr int kRows = 6, kIdleRow = 4;
    const int gate_ld = D + 8;
    std::mt19937 rng(D);
    std::vector<float> source = Random(kRows * D, rng);
    std::fill(source.begin() + kIdleRow * D, source.begin() + (kIdleRow + 1) * D, 0.0f);
    const std::vector<float> weight = Random(D, rng), bias = Random(D, rng),
                             gate = Random(kRows * gate_ld, rng);
    // The order the decode kernel would take the segments in, one of them idle.
    std::vector<cu::Segment> order;
    for (const int row : {3, 0, 5, 1, kIdleRow, 2}) {
      order.push_back({.row = row, .count = row == kIdleRow ? 0 : 1, .slot = 0, .start = 0});
    }
    DeviceArray<float> d_weight(weight), d_bias(bias), d_gate(gate);
    DeviceArray<cu::Segment> d_order(order);

    DeviceArray<float> plain_x(source), plain_y(std::vector<float>(kRows * D));
    ASSERT_EQ(
        cu::PostNormGate(plain_x.get(), kRows, D, d_weight.get(), d_bias.get(), 1e-6f, d_gate.get(),
                         gate_ld, nullptr, plain_y.get(), cu::ElementType::kFloat32, nullptr),
        cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    // The awaited form starts on rows still pending; another stream writes them (all but the
    // idle one) 20 ms later.
    DeviceArray<float> x(std::vector<float>(kRows * D)), y(std::vector<float>(kRows * D));
    ASSERT_EQ(cudaMemset(x.get(), 0xFF, kRows * D * sizeof(float)), cudaSuccess);
    cudaStream_t norm_stream, writer;
    ASSERT_EQ(cudaStreamCreateWithFlags(&norm_stream, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&writer, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(
        cu::PostNormGate(x.get(), kRows, D, d_weight.get(), d_bias.get(), 1e-6f, d_gate.get(),
                         gate_ld, d_order.get(), y.get(), cu::ElementType::kFloat32, norm_stream),
        cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(
                  writer, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); },
                  nullptr),
              cudaSuccess);
    for (const cu::Segment& segment : order) {
      if (segment.count == 0) continue;
      const size_t offset = static_cast<size_t>(segment.row) * D;
      ASSERT_EQ(cudaMemcpyAsync(x.get() + offset, source.data() + offset, D * sizeof(float),
                                cudaMemcpyHostToDevice, writer),
                cudaSuccess);
    }
    ASSERT_EQ(cudaStreamSynchronize(writer), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(norm_stream), cudaSuccess);
    cudaStreamDestroy(writer);
    cudaStreamDestroy(norm_stream);

    const std::vector<float> expected = plain_y.ToHost(), made = y.ToHost();
    for (int i = 0; i < kRows * D; ++i) {
      ASSERT_EQ(Bits(made[i]), Bits(expected[i])) << "row " << i / D << ", column " << i % D;
    }
    for (const float left : x.ToHost()) ASSERT_EQ(Bits(left), cu::kRowPending);
  }
}

}  // namespace
}  // namespace ttt
