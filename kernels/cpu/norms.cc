#include "kernels/cpu/eigen_types.h"
#include "kernels/cpu_ops.h"

namespace ttt::kernels::cpu {

void RmsNorm(const float* x, int64_t n, int64_t d, const float* w, float eps, float* y) {
  ConstMatrixMap in(x, n, d);
  MatrixMap out(y, n, d);
  ConstRowVectorMap weight(w, d);
  for (int64_t i = 0; i < n; ++i) {
    const float inv_rms = 1.0f / std::sqrt(in.row(i).squaredNorm() / d + eps);
    out.row(i) = (in.row(i) * inv_rms).cwiseProduct(weight);
  }
}

void LayerNorm(const float* x, int64_t n, int64_t d, const float* w, const float* b, float eps,
               float* y) {
  ConstMatrixMap in(x, n, d);
  MatrixMap out(y, n, d);
  ConstRowVectorMap weight(w, d), bias(b, d);
  for (int64_t i = 0; i < n; ++i) {
    const float mean = in.row(i).mean();
    const RowVector centered = in.row(i).array() - mean;
    const float inv_std = 1.0f / std::sqrt(centered.squaredNorm() / d + eps);
    out.row(i) = (centered * inv_std).cwiseProduct(weight) + bias;
  }
}

}  // namespace ttt::kernels::cpu
