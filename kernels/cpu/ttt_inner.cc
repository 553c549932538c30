// The TTT inner loop for one head: gradients at θ0, dual-form outputs, window commits.
#include <algorithm>

#include "kernels/cpu/eigen_types.h"
#include "kernels/cpu_ops.h"

namespace ttt::kernels::cpu {
namespace {

// Row-wise inner LayerNorm of z [m, f]: returns LN(z); *xhat and *inv_std get what the backward
// pass needs.
RowMatrix InnerLayerNorm(const RowMatrix& z, const TttHeadParams& p, RowMatrix* xhat,
                         Eigen::VectorXf* inv_std) {
  const int64_t m = z.rows(), f = z.cols();
  ConstRowVectorMap gamma(p.ln_weight, f), beta(p.ln_bias, f);
  xhat->resize(m, f);
  inv_std->resize(m);
  RowMatrix y(m, f);
  for (int64_t i = 0; i < m; ++i) {
    const RowVector centered = z.row(i).array() - z.row(i).mean();
    (*inv_std)(i) = 1.0f / std::sqrt(centered.squaredNorm() / f + p.ln_eps);
    xhat->row(i) = centered * (*inv_std)(i);
    y.row(i) = xhat->row(i).cwiseProduct(gamma) + beta;
  }
  return y;
}

// ∂/∂z of ½‖LN(z) − target‖² for each row (LN and L2 fused, spec §3.5).
RowMatrix LayerNormL2Gradient(const RowMatrix& z, const RowMatrix& target, const TttHeadParams& p) {
  RowMatrix xhat;
  Eigen::VectorXf inv_std;
  const RowMatrix y = InnerLayerNorm(z, p, &xhat, &inv_std);
  const int64_t f = z.cols();
  ConstRowVectorMap gamma(p.ln_weight, f);
  RowMatrix grad(z.rows(), f);
  for (int64_t i = 0; i < z.rows(); ++i) {
    const RowVector e = (y.row(i) - target.row(i)).cwiseProduct(gamma);
    const float sum_e = e.sum();
    const float sum_e_xhat = e.dot(xhat.row(i));
    grad.row(i) = (float(f) * e - RowVector::Constant(f, sum_e) - xhat.row(i) * sum_e_xhat) *
                  (inv_std(i) / float(f));
  }
  return grad;
}

RowMatrix GeluOf(const RowMatrix& z) { return z.unaryExpr([](float x) { return Gelu(x); }); }

}  // namespace

void TttHeadForward(const TttHeadParams& p, const TttHeadState& s, int64_t start, int64_t n,
                    const float* q, const float* k, const float* v, int64_t ld, const float* lr,
                    int64_t lr_stride, float* out) {
  const int64_t f = p.f, f1 = p.f1, K = p.K;
  MatrixMap W1(s.W1, f, f1);
  RowVectorMap b1(s.b1, f1);
  MatrixMap pending_k(s.k, K, f), pending_g1(s.g1, K, f1);
  Eigen::Map<Eigen::VectorXf> pending_lr(s.lr, K);

  for (int64_t done = 0; done < n;) {
    // The tokens of this call that fall in one window: in-window indices r0 .. r1−1.
    const int64_t r0 = (start + done) % K;
    const int64_t m = std::min(n - done, K - r0);
    const int64_t r1 = r0 + m;
    ConstStridedMap Q(q + done * ld, m, f, Eigen::OuterStride<>(ld));
    ConstStridedMap Kc(k + done * ld, m, f, Eigen::OuterStride<>(ld));
    ConstStridedMap Vc(v + done * ld, m, f, Eigen::OuterStride<>(ld));
    const RowMatrix target = Vc - Kc;

    // 1. Each new token's gradient at θ0, appended to the window's pending tokens.
    RowMatrix z1 = Kc * W1;
    z1.rowwise() += b1;
    pending_k.middleRows(r0, m) = Kc;
    for (int64_t i = 0; i < m; ++i) pending_lr(r0 + i) = lr[(done + i) * lr_stride];
    if (!p.mlp) {
      pending_g1.middleRows(r0, m) = LayerNormL2Gradient(z1, target, p);
    } else {
      MatrixMap W2(s.W2, f1, f), pending_x2(s.x2, K, f1), pending_g2(s.g2, K, f);
      RowVectorMap b2(s.b2, f);
      const RowMatrix x2 = GeluOf(z1);
      RowMatrix z2 = x2 * W2;
      z2.rowwise() += b2;
      const RowMatrix g2 = LayerNormL2Gradient(z2, target, p);
      pending_x2.middleRows(r0, m) = x2;
      pending_g2.middleRows(r0, m) = g2;
      const auto gelu_derivative = z1.unaryExpr([](float x) { return GeluDerivative(x); });
      pending_g1.middleRows(r0, m) = (g2 * W2.transpose()).cwiseProduct(gelu_derivative);
    }

    // 2. Outputs: row i sees the window's tokens j ≤ r0+i through η_ij = τ_i · lr_j.
    RowMatrix eta = RowMatrix::Zero(m, r1);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j <= r0 + i; ++j) eta(i, j) = p.tau[r0 + i] * pending_lr(j);
    }
    auto attention = [&](const RowMatrix& queries, const auto& keys) {
      RowMatrix a = queries * keys.topRows(r1).transpose();
      return RowMatrix((a.array() + 1.0f) * eta.array());
    };
    RowMatrix zbar = Q * W1;
    zbar.rowwise() += b1;
    zbar.noalias() -= attention(Q, pending_k) * pending_g1.topRows(r1);
    if (p.mlp) {
      MatrixMap W2(s.W2, f1, f), pending_x2(s.x2, K, f1), pending_g2(s.g2, K, f);
      RowVectorMap b2(s.b2, f);
      const RowMatrix x2bar = GeluOf(zbar);
      zbar = x2bar * W2;
      zbar.rowwise() += b2;
      zbar.noalias() -= attention(x2bar, pending_x2) * pending_g2.topRows(r1);
    }
    RowMatrix xhat;
    Eigen::VectorXf inv_std;
    StridedMap(out + done * ld, m, f, Eigen::OuterStride<>(ld)) =
        Q + InnerLayerNorm(zbar, p, &xhat, &inv_std);

    // 3. After the window's last token θ0 takes the last token's θ̄.
    if (r1 == K) {
      const Eigen::VectorXf w = p.tau[K - 1] * pending_lr;
      W1.noalias() -= pending_k.transpose() * w.asDiagonal() * pending_g1;
      b1.noalias() -= w.transpose() * pending_g1;
      if (p.mlp) {
        MatrixMap W2(s.W2, f1, f), pending_x2(s.x2, K, f1), pending_g2(s.g2, K, f);
        RowVectorMap b2(s.b2, f);
        W2.noalias() -= pending_x2.transpose() * w.asDiagonal() * pending_g2;
        b2.noalias() -= w.transpose() * pending_g2;
      }
    }
    done += m;
  }
}

}  // namespace ttt::kernels::cpu
