// SkinnyGemm, the small-batch product, against a double-precision product of the same rounded
// inputs, for every row count it takes, both input types, ragged widths and odd output counts.
// Skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/cuda_device.h"
#include "kernels/cuda_ops.h"

namespace ttt {
namespace {

namespace cu = kernels::cuda;

struct Case {
  int rows, in, out;
  cu::ElementType type;
  bool accumulate;
};

// A device copy of host values, freed on scope exit.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : size_(host.size()) {
    EXPECT_EQ(cudaMalloc(&data_, bytes()), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(data_, host.data(), bytes(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceArray() { cudaFree(data_); }
  T* get() const { return data_; }
  std::vector<T> ToHost() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes(), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }

 private:
  size_t bytes() const { return size_ * sizeof(T); }
  T* data_ = nullptr;
  size_t size_;
};

// Runs one case on inputs of `Element` (bf16 or float) and checks every output against the sum
// in double of the same values, to float32's accumulation error.
template <typename Element>
void Check(const Case& c) {
  std::mt19937 rng(c.rows * 7919 + c.in * 31 + c.out);
  std::normal_distribution<float> normal;
  std::vector<Element> x(c.rows * c.in), w(static_cast<size_t>(c.out) * c.in);
  for (Element& v : x) v = Element(normal(rng));
  for (Element& v : w) v = Element(normal(rng));
  std::vector<float> y(c.rows * c.out);
  for (float& v : y) v = normal(rng);

  DeviceArray<Element> dx(x), dw(w);
  DeviceArray<float> dy(y);
  ASSERT_TRUE(cu::SkinnyGemmFits(c.rows, c.in, c.type, dx.get(), dw.get()));
  ASSERT_EQ(cu::SkinnyGemm(c.rows, dx.get(), dw.get(), c.in, c.out, c.type, dy.get(),
                           c.accumulate, nullptr),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = dy.ToHost();

  for (int r = 0; r < c.rows; ++r) {
    for (int o = 0; o < c.out; ++o) {
      double want = c.accumulate ? y[r * c.out + o] : 0.0, magnitude = std::abs(want);
      for (int k = 0; k < c.in; ++k) {
        const double term = static_cast<double>(static_cast<float>(x[r * c.in + k])) *
                            static_cast<float>(w[static_cast<size_t>(o) * c.in + k]);
        want += term;
        magnitude += std::abs(term);
      }
      ASSERT_NEAR(got[r * c.out + o], want, 1e-6 * magnitude + 1e-6)
          << "row " << r << ", output " << o;
    }
  }
}

class SkinnyGemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(SkinnyGemmTest, MatchesTheProductInDouble) {
  if (cu::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const Case& c = GetParam();
  if (c.type == cu::ElementType::kBFloat16) {
    Check<__nv_bfloat16>(c);
  } else {
    Check<float>(c);
  }
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (const cu::ElementType type : {cu::ElementType::kBFloat16, cu::ElementType::kFloat32}) {
    for (const int rows : {1, 2, 4}) {
      // A model's shapes (d = 2048, I = 5504): rows split among 1, 2 (float32) or 4 warps, and
      // more outputs than the resident blocks take at once. Then a width below one vector a
      // lane, and odd output counts.
      cases.push_back({rows, 2048, 2048, type, true});
      cases.push_back({rows, 2048, 11008, type, false});
      cases.push_back({rows, 5504, 257, type, false});
      cases.push_back({rows, 72, 9, type, true});
      cases.push_back({rows, 1024, 1, type, false});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(RowsWidthsAndTypes, SkinnyGemmTest, ::testing::ValuesIn(Cases()));

TEST(SkinnyGemmFitsTest, RefusesWhatItCannotLoadInVectors) {
  alignas(16) static float buffer[64];
  const cu::ElementType bf16 = cu::ElementType::kBFloat16, f32 = cu::ElementType::kFloat32;
  EXPECT_TRUE(cu::SkinnyGemmFits(4, 16, bf16, buffer, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(cu::kMaxSkinnyGemmRows + 1, 16, bf16, buffer, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(0, 16, bf16, buffer, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(1, 12, bf16, buffer, buffer));  // 12 is not whole vectors.
  EXPECT_TRUE(cu::SkinnyGemmFits(1, 12, f32, buffer, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(1, 16, f32, buffer + 1, buffer));  // x off 16 bytes.
  EXPECT_EQ(cu::SkinnyGemm(1, buffer, buffer + 1, 16, 4, f32, buffer, false, nullptr),
            cudaErrorNotSupported);
}

}  // namespace
}  // namespace ttt
