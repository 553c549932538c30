// SkinnyGemm, the small-batch product, against a double-precision product of the same inputs:
// for every row count it takes, both element types, ragged widths and odd output counts; for
// inputs given and (one row) inputs it norms itself; storing, accumulating, and taking the
// SwiGLU of an interleaved gate/up product. Skips without a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
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
using Kind = cu::ProductInput::Kind;
using Output = cu::ProductOutput;

struct Case {
  int rows, in, out;
  cu::ElementType type;
  Kind input = Kind::kRows;
  Output output = Output::kStore;
  bool gate = true;  // kLayerNormGate: with a gate.
};

std::string Describe(const Case& c) {
  const char* input[] = {"Rows", "RmsNorm", "LayerNorm"};
  const char* output[] = {"Store", "Accumulate", "SwiGlu"};
  return std::string(c.type == cu::ElementType::kBFloat16 ? "Bf16" : "F32") + "_" +
         std::to_string(c.rows) + "x" + std::to_string(c.in) + "x" + std::to_string(c.out) + "_" +
         input[static_cast<int>(c.input)] +
         (c.input == Kind::kLayerNormGate && !c.gate ? "NoGate" : "") + "_" +
         output[static_cast<int>(c.output)];
}

void PrintTo(const Case& c, std::ostream* out) { *out << Describe(c); }

float Gelu(float x) {
  return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x)));
}

// The input rows the product multiplies, made on the host as the kernels make them: the row's
// statistics (summed in double, nearer the kernels' tree sums than a float running sum), then
// each element in float, rounded to Element.
template <typename Element>
std::vector<float> InputRows(const Case& c, const std::vector<float>& source,
                             const std::vector<float>& weight, const std::vector<float>& bias,
                             const std::vector<float>& gate, int gate_ld, float eps) {
  std::vector<float> x(source.size());
  for (int r = 0; r < c.rows; ++r) {
    const float* v = &source[r * c.in];
    double sum = 0, squares = 0;
    if (c.input == Kind::kLayerNormGate) {
      for (int k = 0; k < c.in; ++k) sum += v[k];
    }
    const float mean = static_cast<float>(sum / c.in);
    for (int k = 0; k < c.in; ++k) squares += double{v[k] - mean} * (v[k] - mean);
    const float scale = static_cast<float>(1.0 / std::sqrt(squares / c.in + eps));
    for (int k = 0; k < c.in; ++k) {
      float value = (v[k] - mean) * scale * weight[k];
      if (c.input == Kind::kLayerNormGate) {
        value += bias[k];
        if (c.gate) value *= Gelu(gate[r * gate_ld + k]);
      }
      x[r * c.in + k] = static_cast<float>(Element(value));
    }
  }
  return x;
}

// Runs one case on weights of `Element` (bf16 or float) and checks every output against sums in
// double of the same input rows. The tolerance covers float32 accumulation and, for inputs made
// on the device, a rare different rounding of one element to bf16.
template <typename Element>
void Check(const Case& c) {
  std::mt19937 rng(c.rows * 7919 + c.in * 31 + c.out + static_cast<int>(c.input) * 3 +
                   static_cast<int>(c.output));
  std::normal_distribution<float> normal;
  auto draw = [&](size_t n, float offset = 0.0f) {
    std::vector<float> v(n);
    for (float& e : v) e = offset + normal(rng);
    return v;
  };
  const int gate_ld = c.in + 4;
  const float eps = 1e-6f;
  const std::vector<float> source = draw(c.rows * c.in, 0.5f), weight = draw(c.in, 1.0f),
                           bias = draw(c.in), gate = draw(c.rows * gate_ld);
  std::vector<Element> w(static_cast<size_t>(c.out) * c.in);
  for (Element& v : w) v = Element(normal(rng));

  std::vector<float> x = source;
  std::vector<Element> given(source.size());
  if (c.input == Kind::kRows) {
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(given[i] = Element(x[i]));
  } else {
    x = InputRows<Element>(c, source, weight, bias, gate, gate_ld, eps);
  }
  const int y_width = c.output == Output::kSwiGlu ? c.out / 2 : c.out;
  const std::vector<float> y_before = draw(c.rows * y_width);

  DeviceArray<Element> d_given(given), d_w(w);
  DeviceArray<float> d_source(source), d_weight(weight), d_bias(bias), d_gate(gate);
  cu::ProductInput input{.kind = c.input};
  if (c.input == Kind::kRows) {
    input.rows = d_given.get();
  } else {
    input.source = d_source.get();
    input.weight = d_weight.get();
    input.bias = d_bias.get();
    input.eps = eps;
    input.gate = c.gate ? d_gate.get() : nullptr;
    input.gate_ld = gate_ld;
  }
  ASSERT_TRUE(cu::SkinnyGemmFits(c.rows, input, c.in, c.type, d_w.get()));
  std::vector<float> got;
  if (c.output == Output::kSwiGlu) {
    DeviceArray<Element> d_y(std::vector<Element>(c.rows * y_width));
    ASSERT_EQ(cu::SkinnyGemm(c.rows, input, d_w.get(), c.in, c.out, c.type, c.output, d_y.get(),
                             nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (Element e : d_y.ToHost()) got.push_back(static_cast<float>(e));
  } else {
    DeviceArray<float> d_y(y_before);
    ASSERT_EQ(cu::SkinnyGemm(c.rows, input, d_w.get(), c.in, c.out, c.type, c.output, d_y.get(),
                             nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    got = d_y.ToHost();
  }

  const bool bf16 = c.type == cu::ElementType::kBFloat16;
  auto product = [&](int r, int o, double* magnitude) {
    double sum = 0;
    *magnitude = 0;
    for (int k = 0; k < c.in; ++k) {
      const double term = static_cast<double>(x[r * c.in + k]) *
                          static_cast<float>(w[static_cast<size_t>(o) * c.in + k]);
      sum += term;
      *magnitude += std::abs(term);
    }
    return sum;
  };
  const double flips = c.input != Kind::kRows && bf16 ? 0.1 : 1e-5;
  for (int r = 0; r < c.rows; ++r) {
    for (int j = 0; j < y_width; ++j) {
      const float value = got[r * y_width + j];
      if (c.output == Output::kSwiGlu) {
        double m_gate = 0, m_up = 0;
        const double g = product(r, 2 * j, &m_gate), u = product(r, 2 * j + 1, &m_up);
        const double silu = g / (1.0 + std::exp(-g)), want = silu * u;
        const double tolerance = std::abs(want) * (bf16 ? 1.0 / 256 : 1e-6) +
                                 1.1 * std::abs(u) * (1e-6 * m_gate + flips) +
                                 std::abs(silu) * (1e-6 * m_up + flips);
        ASSERT_NEAR(value, want, tolerance) << "row " << r << ", output " << j;
      } else {
        double magnitude = 0;
        double want = product(r, j, &magnitude);
        if (c.output == Output::kAccumulate) want += y_before[r * y_width + j];
        ASSERT_NEAR(value, want, 1e-6 * magnitude + flips) << "row " << r << ", output " << j;
      }
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
      // Given rows at a model's shapes (d = 2048, I = 5504): rows split among 1, 2 (float32) or
      // 4 warps. Then a width below one vector a lane, and odd output counts.
      cases.push_back({rows, 2048, 2048, type, Kind::kRows, Output::kAccumulate});
      cases.push_back({rows, 5504, 257, type});
      cases.push_back({rows, 72, 9, type, Kind::kRows, Output::kAccumulate});
      cases.push_back({rows, 1024, 1, type});
    }
    // Input rows made by the product (one row): o_proj's, the feed-forward's, the LM head's.
    cases.push_back({1, 2048, 2048, type, Kind::kLayerNormGate, Output::kAccumulate});
    cases.push_back({1, 768, 130, type, Kind::kLayerNormGate, Output::kStore, false});
    cases.push_back({1, 2048, 1024, type, Kind::kRmsNorm, Output::kSwiGlu});
    cases.push_back({1, 5504, 3001, type, Kind::kRmsNorm});
    // Many output pairs a warp, each one chunk or less (bf16) or two (float32): 125m's LM head.
    cases.push_back({1, 768, 32000, type, Kind::kRmsNorm});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, SkinnyGemmTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return Describe(info.param);
                         });

TEST(SkinnyGemmFitsTest, RefusesWhatItCannotLoadInVectors) {
  alignas(16) static float buffer[64];
  const cu::ElementType bf16 = cu::ElementType::kBFloat16, f32 = cu::ElementType::kFloat32;
  const cu::ProductInput given{.rows = buffer}, off{.rows = buffer + 1};
  EXPECT_TRUE(cu::SkinnyGemmFits(4, given, 16, bf16, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(cu::kMaxSkinnyGemmRows + 1, given, 16, bf16, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(0, given, 16, bf16, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(3, given, 16, bf16, buffer));  // Built for 1, 2 and 4 rows.
  EXPECT_FALSE(cu::SkinnyGemmFits(1, given, 12, bf16, buffer));  // 12 is not whole vectors.
  EXPECT_TRUE(cu::SkinnyGemmFits(1, given, 12, f32, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(1, off, 16, f32, buffer));  // x off 16 bytes.
  EXPECT_EQ(cu::SkinnyGemm(1, given, buffer + 1, 16, 4, f32, Output::kStore, buffer, nullptr),
            cudaErrorNotSupported);
  // A norm's input is made for one row, in shared memory: at most 48 KB of it.
  const cu::ProductInput norm{
      .kind = Kind::kRmsNorm, .source = buffer, .weight = buffer, .eps = 1e-6f};
  EXPECT_TRUE(cu::SkinnyGemmFits(1, norm, 12288, f32, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(1, norm, 12292, f32, buffer));
  EXPECT_TRUE(cu::SkinnyGemmFits(1, norm, 24576, bf16, buffer));
  EXPECT_FALSE(cu::SkinnyGemmFits(2, norm, 1024, bf16, buffer));
}

}  // namespace
}  // namespace ttt
