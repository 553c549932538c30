#include <algorithm>
#include <cstring>

#include "kernels/cpu_ops.h"

namespace ttt::kernels::cpu {

void CausalConv(const float* x, int64_t n, int64_t d, const float* w, const float* b, int64_t ck,
                const float* history, float* y) {
  const int64_t h = ck - 1;  // Rows of history.
  for (int64_t t = 0; t < n; ++t) {
    float* out = y + t * d;
    for (int64_t c = 0; c < d; ++c) out[c] = b[c];
    for (int64_t j = 0; j < ck; ++j) {
      // Tap j reads the input at t − (ck−1) + j; negative indices come from history.
      const int64_t s = t - h + j;
      const float* in = s >= 0 ? x + s * d : history + (h + s) * d;
      for (int64_t c = 0; c < d; ++c) out[c] += w[c * ck + j] * in[c];
    }
  }
}

void AdvanceConvHistory(const float* x, int64_t n, int64_t d, int64_t ck, float* history) {
  const int64_t h = ck - 1;
  if (h == 0) return;
  const int64_t keep = std::max<int64_t>(0, h - n);  // Old rows that stay, moved to the front.
  std::memmove(history, history + (h - keep) * d, keep * d * sizeof(float));
  const int64_t take = h - keep;
  std::memcpy(history + keep * d, x + (n - take) * d, take * d * sizeof(float));
}

}  // namespace ttt::kernels::cpu
