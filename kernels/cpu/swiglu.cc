#include <cmath>

#include "kernels/cpu_ops.h"

namespace ttt::kernels::cpu {

void SwiGluActivation(const float* gate, const float* up, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    y[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

}  // namespace ttt::kernels::cpu
