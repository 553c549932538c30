#include <cmath>
#include <vector>

#include "kernels/cpu_ops.h"

namespace ttt::kernels::cpu {

void RopeCosSin(int64_t p, int64_t f, double theta, float* cos, float* sin) {
  for (int64_t i = 0; i < f / 2; ++i) {
    const float omega = static_cast<float>(1.0 / std::pow(theta, double(2 * i) / double(f)));
    const float angle = static_cast<float>(p) * omega;
    cos[i] = std::cos(angle);
    sin[i] = std::sin(angle);
  }
}

void ApplyRope(float* x, int64_t n, int64_t ld, int64_t nh, int64_t f, int64_t start, int64_t K,
               double theta) {
  std::vector<float> cos_table(f / 2), sin_table(f / 2);
  for (int64_t t = 0; t < n; ++t) {
    RopeCosSin((start + t) % K, f, theta, cos_table.data(), sin_table.data());
    float* row = x + t * ld;
    for (int64_t h = 0; h < nh; ++h) {
      float* head = row + h * f;
      for (int64_t i = 0; i < f / 2; ++i) {
        const float a = head[2 * i], b = head[2 * i + 1];
        head[2 * i] = a * cos_table[i] - b * sin_table[i];
        head[2 * i + 1] = b * cos_table[i] + a * sin_table[i];
      }
    }
  }
}

}  // namespace ttt::kernels::cpu
