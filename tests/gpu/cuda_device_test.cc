// The CUDA toolchain end to end: a kernel built for this GPU runs and computes. Skips without a
// GPU.
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cuda_device.h"

namespace ttt {
namespace {

TEST(CudaDeviceTest, KernelRunsOnTheGpu) {
  if (kernels::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  std::vector<float> x(1000), y(1000);
  for (int i = 0; i < 1000; ++i) x[i] = i, y[i] = 1.0f;
  ASSERT_EQ(kernels::cuda::Saxpy(2.0f, x.data(), y.data(), 1000), "");
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(y[i], 2.0f * i + 1.0f) << i;
}

}  // namespace
}  // namespace ttt
