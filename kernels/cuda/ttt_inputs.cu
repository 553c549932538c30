// Per-sequence position-dependent ops: causal convs with their histories, RoPE, inner step sizes.
#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row; threads over channels.
__global__ void CausalConvKernel(const float* x, int D, const float* w, const float* b, int ck,
                                 const Segment* segments, const int32_t* row_segment,
                                 StateAddress state, size_t history_offset, float* y,
                                 bool accumulate) {
  const int row = blockIdx.x;
  const Segment seg = segments[row_segment[row]];
  const int i = row - seg.row;  // Index within the segment.
  const float* history = SequenceState(state, seg.slot) + history_offset;
  const int h = ck - 1;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float acc = b[c];
    for (int j = 0; j < ck; ++j) {
      const int s = i - h + j;  // Tap j reads input s of this segment; before 0: the history.
      const float in = s >= 0 ? x[static_cast<int64_t>(seg.row + s) * D + c] : history[(h + s) * D + c];
      acc += w[c * ck + j] * in;
    }
    float* out = y + static_cast<int64_t>(row) * D + c;
    *out = accumulate ? *out + acc : acc;
  }
}

// One block per segment: history ← the last ck−1 rows of (history ++ segment rows).
__global__ void AdvanceHistoryKernel(const float* x, int D, int ck, const Segment* segments,
                                     StateAddress state, size_t history_offset) {
  const Segment seg = segments[blockIdx.x];
  if (seg.count == 0) return;
  float* history = SequenceState(state, seg.slot) + history_offset;
  const int h = ck - 1;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float kept[8];  // ck ≤ 9 (checked by the launcher).
    for (int r = 0; r < h; ++r) {
      const int s = seg.count - h + r;  // Source: segment row s, or history row h + s.
      kept[r] = s >= 0 ? x[static_cast<int64_t>(seg.row + s) * D + c] : history[(h + s) * D + c];
    }
    for (int r = 0; r < h; ++r) history[r * D + c] = kept[r];
  }
}

__device__ __forceinline__ void RotatePair(float* v, float cos_a, float sin_a) {
  const float a = v[0], b = v[1];
  v[0] = a * cos_a - b * sin_a;
  v[1] = b * cos_a + a * sin_a;
}

__global__ void RopeKernel(float* q, float* k, int nh, int f, int K, float theta,
                           const Segment* segments, const int32_t* row_segment) {
  const int row = blockIdx.x;
  const Segment seg = segments[row_segment[row]];
  const int p = static_cast<int>((seg.start + (row - seg.row)) % K);
  const int D = nh * f;
  for (int pair = threadIdx.x; pair < D / 2; pair += blockDim.x) {
    const int i = pair % (f / 2);
    // As the reference: float32 frequency times the integer position.
    const float omega = static_cast<float>(1.0 / pow(static_cast<double>(theta), 2.0 * i / f));
    float sin_a, cos_a;
    sincosf(static_cast<float>(p) * omega, &sin_a, &cos_a);
    RotatePair(q + static_cast<int64_t>(row) * D + 2 * pair, cos_a, sin_a);
    RotatePair(k + static_cast<int64_t>(row) * D + 2 * pair, cos_a, sin_a);
  }
}

__global__ void LearningRateKernel(float* lr, int64_t n, int nh, const float* bias, float base_lr,
                                   int f) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) lr[i] = base_lr / (1.0f + expf(-(lr[i] + bias[i % nh]))) / f;
}

}  // namespace

cudaError_t CausalConv(const float* x, int rows, int D, const float* weight, const float* bias,
                       int ck, const Segment* segments, const int32_t* row_segment,
                       StateAddress state, size_t history_offset, float* y, bool accumulate,
                       cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  CausalConvKernel<<<rows, kThreads, 0, stream>>>(x, D, weight, bias, ck, segments, row_segment,
                                                  state, history_offset, y, accumulate);
  return cudaGetLastError();
}

cudaError_t AdvanceConvHistory(const float* x, int num_segments, int D, int ck,
                               const Segment* segments, StateAddress state, size_t history_offset,
                               cudaStream_t stream) {
  if (ck - 1 > 8) return cudaErrorInvalidValue;
  if (num_segments == 0 || ck == 1) return cudaSuccess;
  AdvanceHistoryKernel<<<num_segments, kThreads, 0, stream>>>(x, D, ck, segments, state,
                                                              history_offset);
  return cudaGetLastError();
}

cudaError_t ApplyRope(float* q, float* k, int rows, int nh, int f, int K, float theta,
                      const Segment* segments, const int32_t* row_segment, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RopeKernel<<<rows, kThreads, 0, stream>>>(q, k, nh, f, K, theta, segments, row_segment);
  return cudaGetLastError();
}

cudaError_t InnerLearningRate(float* lr, int rows, int nh, const float* bias, float base_lr,
                              int f, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * nh;
  if (n == 0) return cudaSuccess;
  LearningRateKernel<<<(n + kThreads - 1) / kThreads, kThreads, 0, stream>>>(lr, n, nh, bias,
                                                                             base_lr, f);
  return cudaGetLastError();
}

}  // namespace ttt::kernels::cuda
