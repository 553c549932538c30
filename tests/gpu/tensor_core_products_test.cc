// The decode products on Hopper's tensor cores against the same arithmetic in double on the host:
// cu::TensorCoreProduct's sums, and cu::FeedForwardEntry's h after o_proj, the norm's bf16 input
// and the SwiGLU activation from gate_up scaled by each row's 1/rms. At 125m's shapes, at ragged
// row counts (rows past the last tile's are not written) and at widths that end inside a tile and
// inside a 64-wide slice of K. Skips without a GPU that runs sm_90a code.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda_device.h"
#include "kernels/cuda_ops.h"
#include "tests/gpu/device_array.h"

namespace ttt {
namespace {

namespace cu = kernels::cuda;
using testing::DeviceArray;
using bf16 = __nv_bfloat16;

struct Shape {
  int rows, D, I;
};

std::vector<bf16> RandomBf16(size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<bf16> v(n);
  for (bf16& e : v) e = __float2bfloat16(normal(rng));
  return v;
}

std::vector<float> RandomFloats(size_t n, float mean, float scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(mean, scale);
  std::vector<float> v(n);
  for (float& e : v) e = normal(rng);
  return v;
}

// Σ_k a[k] · b[k] over bf16 rows of length n, in double, and Σ |a[k] · b[k]|.
double Dot(const bf16* a, const bf16* b, int n, double* magnitude) {
  double sum = 0;
  *magnitude = 0;
  for (int k = 0; k < n; ++k) {
    const double term = static_cast<double>(__bfloat162float(a[k])) * __bfloat162float(b[k]);
    sum += term;
    *magnitude += std::abs(term);
  }
  return sum;
}

class TensorCoreProductsTest : public ::testing::TestWithParam<Shape> {};

TEST_P(TensorCoreProductsTest, FeedForwardEntryMatchesDouble) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const auto [rows, D, I] = GetParam();
  if (!cu::TensorCoreProductsAvailable(D, I)) {
    GTEST_SKIP() << "this GPU does not run sm_90a code";
  }
  constexpr float kEps = 1e-5f;
  const int row_stride = rows + 7;  // Any stride of at least the rows.
  std::mt19937 rng(static_cast<unsigned>(rows * 7919 + D * 31 + I));
  const std::vector<bf16> gated = RandomBf16(static_cast<size_t>(rows) * D, 1.0f, rng);
  const std::vector<bf16> o_proj = RandomBf16(static_cast<size_t>(D) * D, 1.0f / std::sqrt(D), rng);
  const std::vector<bf16> gate_up =
      RandomBf16(static_cast<size_t>(2 * I) * D, 1.0f / std::sqrt(D), rng);
  const std::vector<float> norm_weight = RandomFloats(D, 1.0f, 0.2f, rng);
  // h [rows + 1, D]: the row past the step's is a sentinel no kernel may write.
  const std::vector<float> h_before = RandomFloats(static_cast<size_t>(rows + 1) * D, 0, 1, rng);
  const float kSentinel = __bfloat162float(__float2bfloat16(12345.0f));  // Exact in bf16 too.
  const int square_tiles = cu::FeedForwardEntry::SquareTiles(D);

  DeviceArray<bf16> d_gated(gated), d_o_proj(o_proj), d_gate_up(gate_up);
  DeviceArray<float> d_norm_weight(norm_weight), d_h(h_before);
  DeviceArray<bf16> d_normed(
      std::vector<bf16>(static_cast<size_t>(rows + 1) * D, __float2bfloat16(kSentinel)));
  DeviceArray<float> d_squares(std::vector<float>(static_cast<size_t>(square_tiles) * row_stride));
  DeviceArray<bf16> d_activation(
      std::vector<bf16>(static_cast<size_t>(rows + 1) * I, __float2bfloat16(kSentinel)));
  const cu::FeedForwardEntry entry{.D = D,
                                   .I = I,
                                   .eps = kEps,
                                   .o_proj = d_o_proj.get(),
                                   .gate_up = d_gate_up.get(),
                                   .ffn_norm_weight = d_norm_weight.get(),
                                   .post_norm_rows = d_gated.get(),
                                   .h = d_h.get(),
                                   .normed = d_normed.get(),
                                   .row_squares = d_squares.get(),
                                   .row_stride = row_stride,
                                   .activation = d_activation.get()};
  ASSERT_EQ(entry.Run(rows, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> h = d_h.ToHost();
  const std::vector<bf16> normed = d_normed.ToHost();
  const std::vector<bf16> activation = d_activation.ToHost();

  for (int r = 0; r < rows; ++r) {
    // o_proj: h += gated · o_projᵀ, and the norm's input.
    std::vector<double> h_want(D);
    double squares = 0;
    for (int o = 0; o < D; ++o) {
      double magnitude = 0;
      const size_t at = static_cast<size_t>(r) * D + o;
      h_want[o] = h_before[at] + Dot(&gated[static_cast<size_t>(r) * D],
                                     &o_proj[static_cast<size_t>(o) * D], D, &magnitude);
      ASSERT_NEAR(h[at], h_want[o], 1e-5 * (magnitude + std::abs(h_before[at])) + 1e-6)
          << "h, row " << r << ", column " << o;
      const double normed_want = h_want[o] * norm_weight[o];
      ASSERT_NEAR(__bfloat162float(normed[at]), normed_want, std::abs(normed_want) / 200 + 1e-6)
          << "normed, row " << r << ", column " << o;
      squares += h_want[o] * h_want[o];
    }
    // gate_up from the bf16 input the kernel wrote, scaled by the row's 1/rms, then SwiGLU.
    const double inv_rms = 1.0 / std::sqrt(squares / D + kEps);
    const bf16* x = &normed[static_cast<size_t>(r) * D];
    for (int j = 0; j < I; ++j) {
      double m_gate = 0, m_up = 0;
      const double g = inv_rms * Dot(x, &gate_up[static_cast<size_t>(2 * j) * D], D, &m_gate);
      const double u = inv_rms * Dot(x, &gate_up[static_cast<size_t>(2 * j + 1) * D], D, &m_up);
      const double silu = g / (1.0 + std::exp(-g)), want = silu * u;
      const double tolerance = std::abs(want) / 128 + 1e-5 * inv_rms * (m_gate + m_up) + 1e-6;
      ASSERT_NEAR(__bfloat162float(activation[static_cast<size_t>(r) * I + j]), want, tolerance)
          << "activation, row " << r << ", channel " << j;
    }
  }
  // The row past the step's is untouched.
  for (int o = 0; o < D; ++o) {
    const size_t at = static_cast<size_t>(rows) * D + o;
    ASSERT_EQ(h[at], h_before[at]) << "h past the rows, column " << o;
    ASSERT_EQ(__bfloat162float(normed[at]), kSentinel) << "normed past the rows, column " << o;
  }
  for (int j = 0; j < I; ++j) {
    ASSERT_EQ(__bfloat162float(activation[static_cast<size_t>(rows) * I + j]), kSentinel)
        << "activation past the rows, channel " << j;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TensorCoreProductsTest,
    ::testing::Values(Shape{256, 768, 2048},  // 125m at batch 256.
                      Shape{200, 128, 1536},  // Rows ending inside a tile.
                      Shape{130, 72, 40},     // K ending inside a slice, outputs inside a tile.
                      Shape{64, 1024, 2752}),
    [](const ::testing::TestParamInfo<Shape>& info) {
      return std::to_string(info.param.rows) + "x" + std::to_string(info.param.D) + "x" +
             std::to_string(info.param.I);
    });

struct ProductShape {
  int rows, in, out, ld;
};

class TensorCoreProductTest : public ::testing::TestWithParam<ProductShape> {};

TEST_P(TensorCoreProductTest, SumsMatchDouble) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const auto [rows, in, out, ld] = GetParam();
  if (!cu::TensorCoreProductsAvailable(in, out)) {
    GTEST_SKIP() << "this GPU does not run sm_90a code";
  }
  std::mt19937 rng(static_cast<unsigned>(rows * 7919 + in * 31 + out));
  const std::vector<bf16> x = RandomBf16(static_cast<size_t>(rows) * in, 1.0f, rng);
  const std::vector<bf16> w = RandomBf16(static_cast<size_t>(out) * in, 1.0f / std::sqrt(in), rng);
  // y [rows + 1, ld]: the columns past `out` and the row past the step's are sentinels.
  constexpr float kSentinel = 12345.0f;
  DeviceArray<bf16> d_x(x), d_w(w);
  DeviceArray<float> d_y(std::vector<float>(static_cast<size_t>(rows + 1) * ld, kSentinel));
  ASSERT_EQ(cu::TensorCoreProduct(d_x.get(), rows, in, d_w.get(), out, d_y.get(), ld, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> y = d_y.ToHost();
  for (int r = 0; r <= rows; ++r) {
    for (int o = 0; o < ld; ++o) {
      const float got = y[static_cast<size_t>(r) * ld + o];
      if (r == rows || o >= out) {
        ASSERT_EQ(got, kSentinel) << "y past the product, row " << r << ", column " << o;
        continue;
      }
      double magnitude = 0;
      const double want = Dot(&x[static_cast<size_t>(r) * in], &w[static_cast<size_t>(o) * in],
                              in, &magnitude);
      ASSERT_NEAR(got, want, 1e-5 * magnitude + 1e-6) << "row " << r << ", column " << o;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, TensorCoreProductTest,
    ::testing::Values(ProductShape{256, 768, 2368, 2368},  // 125m's in_proj at batch 256
                      ProductShape{128, 768, 2368, 2368},  // and 128 (their tiles differ).
                      ProductShape{200, 128, 136, 142},    // Rows and outputs inside a tile.
                      ProductShape{130, 72, 40, 40}),      // K ending inside a slice.
    [](const ::testing::TestParamInfo<ProductShape>& info) {
      return std::to_string(info.param.rows) + "x" + std::to_string(info.param.in) + "x" +
             std::to_string(info.param.out) + "_ld" + std::to_string(info.param.ld);
    });

TEST(TensorCoreProductTest, RefusesShapesItCannotTake) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  float* y = nullptr;
  EXPECT_EQ(cu::TensorCoreProduct(nullptr, 1, 100, nullptr, 64, y, 64, nullptr),
            cudaErrorInvalidValue);  // in not a multiple of 8.
  EXPECT_EQ(cu::TensorCoreProduct(nullptr, 1, 64, nullptr, 64, y, 63, nullptr),
            cudaErrorInvalidValue);  // ld under out.
}

TEST(TensorCoreProductsAvailableTest, RefusesWidthsTmaCannotStride) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  // Rows of bf16 are strided in whole 16 bytes only.
  EXPECT_FALSE(cu::TensorCoreProductsAvailable(100, 256));
  EXPECT_FALSE(cu::TensorCoreProductsAvailable(128, 260));
}

}  // namespace
}  // namespace ttt
