#include "kernels/cpu/eigen_types.h"
#include "kernels/cpu_ops.h"

namespace ttt::kernels::cpu {

void Linear(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y) {
  MatrixMap(y, n, out).noalias() =
      ConstMatrixMap(x, n, in) * ConstMatrixMap(w, out, in).transpose();
}

}  // namespace ttt::kernels::cpu
