// The TTT layer's per-sequence inputs: causal convs with their histories, RoPE, inner step sizes.
#include <algorithm>

#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxHistory = 8;  // ck ≤ 9 (checked by the launchers).
// Taps held per channel: kernels come in two sizes, for ck ≤ 4 (every known model) with few
// registers, and for any ck up to 9.
constexpr int kCommonTaps = 4, kMaxTaps = kMaxHistory + 1;
constexpr int kPrepareThreads = 512;

// The inputs of a causal conv's taps at channel c for row i of its segment: tap j reads segment
// row i − h + j, or before the segment's first row the history ([h, D], oldest first; nullptr:
// zeros). All loads are issued before any is used.
template <int kTaps>
struct Taps {
  float in[kTaps];
};

template <int kTaps>
__device__ __forceinline__ Taps<kTaps> LoadTaps(const float* x, int64_t ld, int first_row, int i,
                                                int c, const float* history, int D, int ck) {
  const int h = ck - 1;
  Taps<kTaps> taps;
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j < ck) {
      const int s = i - h + j;
      taps.in[j] = s >= 0 ? x[static_cast<int64_t>(first_row + s) * ld + c]
                          : (history != nullptr ? history[(h + s) * D + c] : 0.0f);
    }
  }
  return taps;
}

// The taps of a segment's only row: the history, then `current` (tap ck−1).
template <int kTaps>
__device__ __forceinline__ Taps<kTaps> DecodeTaps(const float* history, int D, int c, int ck,
                                                  float current) {
  Taps<kTaps> taps;
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j + 1 < ck) {
      taps.in[j] = history != nullptr ? history[j * D + c] : 0.0f;
    } else if (j + 1 == ck) {
      taps.in[j] = current;
    }
  }
  return taps;
}

// bias + Σ_j w[c, j]·tap j.
template <int kTaps>
__device__ __forceinline__ float ConvOf(const Taps<kTaps>& taps, int c, const float* w,
                                        const float* b, int ck) {
  float acc = b[c];
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j < ck) acc += w[c * ck + j] * taps.in[j];
  }
  return acc;
}

// For a segment of one row: its history becomes taps 1..ck−1 (the oldest row drops out).
template <int kTaps>
__device__ __forceinline__ void ShiftHistory(float* history, int D, int ck, int c,
                                             const Taps<kTaps>& taps) {
#pragma unroll
  for (int r = 0; r + 1 < kTaps; ++r) {
    if (r + 1 < ck) history[r * D + c] = taps.in[r + 1];
  }
}

// One block per row; threads over channels.
__global__ void CausalConvKernel(const float* x, int D, const float* w, const float* b, int ck,
                                 const Segment* segments, const int32_t* row_segment,
                                 StateAddress state, size_t history_offset, float* y,
                                 bool accumulate) {
  const int row = blockIdx.x;
  const Segment seg = segments[row_segment[row]];
  const float* history = SequenceState(state, seg.slot) + history_offset;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float acc =
        ConvOf(LoadTaps<kMaxTaps>(x, D, seg.row, row - seg.row, c, history, D, ck), c, w, b, ck);
    float* out = y + static_cast<int64_t>(row) * D + c;
    *out = accumulate ? *out + acc : acc;
  }
}

// One block per segment: history ← the last ck−1 rows of (history ++ segment rows).
__global__ void AdvanceHistoryKernel(const float* x, int64_t ld, int D, int ck,
                                     const Segment* segments, StateAddress state,
                                     size_t history_offset) {
  const Segment seg = segments[blockIdx.x];
  if (seg.count == 0) return;
  float* history = SequenceState(state, seg.slot) + history_offset;
  const int h = ck - 1;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float kept[kMaxHistory];
    for (int r = 0; r < h; ++r) {
      const int s = seg.count - h + r;  // Source: segment row s, or history row h + s.
      kept[r] = s >= 0 ? x[static_cast<int64_t>(seg.row + s) * ld + c] : history[(h + s) * D + c];
    }
    for (int r = 0; r < h; ++r) history[r * D + c] = kept[r];
  }
}

// One block per row (= segment, at most one token each): RMSNorm, conv over the history,
// residual. A thread per channel (up to the block limit).
template <int kTaps>
__global__ void __launch_bounds__(1024)
    PreConvDecodeKernel(float* h, int D, const float* norm_w, float eps, const float* w,
                        const float* b, int ck, const Segment* segments, StateAddress state,
                        size_t history_offset) {
  __shared__ float scratch[kWarp];
  const Segment seg = segments[blockIdx.x];
  const bool live = seg.count > 0;
  float* x = h + static_cast<int64_t>(blockIdx.x) * D;
  float sum = 0;
  for (int c = threadIdx.x; c < D; c += blockDim.x) sum += x[c] * x[c];
  const float inv_rms = rsqrtf(BlockSum(sum, scratch) / D + eps);
  float* history = live ? SequenceState(state, seg.slot) + history_offset : nullptr;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float normed = x[c] * inv_rms * norm_w[c];
    const Taps<kTaps> taps = DecodeTaps<kTaps>(history, D, c, ck, normed);
    x[c] += ConvOf(taps, c, w, b, ck);
    if (live) ShiftHistory(history, D, ck, c, taps);
  }
}

__device__ __forceinline__ void RotatePair(float& a, float& b, float2 cos_sin) {
  const float x = a, y = b;
  a = x * cos_sin.x - y * cos_sin.y;
  b = y * cos_sin.x + x * cos_sin.y;
}

// One block per row; thread t handles the channel pairs (2t, 2t+1) that RoPE rotates together.
template <int kTaps>
__global__ void __launch_bounds__(kPrepareThreads)
    PrepareTttInputsKernel(const float* proj, ProjectionColumns cols, int nh, int f, int K,
                           const float2* rope, QkConv conv, bool share_qk, const float* lr_bias,
                           float base_lr, const Segment* segments, const int32_t* row_segment,
                           StateAddress state, bool rewrite_history, float* q_out, float* k_out,
                           float* v_out, float* lr_out) {
  const int row = blockIdx.x;
  const Segment seg = segments[row_segment[row]];
  const int i = row - seg.row;
  const bool live = i < seg.count;  // Padding rows of a decode graph compute on zero history.
  const int p = live ? static_cast<int>((seg.start + i) % K) : 0;
  const int D = nh * f;
  const float* in = proj + static_cast<int64_t>(row) * cols.ld;
  float* history =
      share_qk && live ? SequenceState(state, seg.slot) + conv.history_offset : nullptr;
  const int64_t out = static_cast<int64_t>(row) * D;
  for (int pair = threadIdx.x; pair < D / 2; pair += blockDim.x) {
    // Loads first (both channels), then arithmetic, then the history's rewrite.
    const float2 cos_sin = rope[p * (f / 2) + pair % (f / 2)];
    float q[2], k[2];
    if (share_qk) {
      Taps<kTaps> taps[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        taps[e] =
            LoadTaps<kTaps>(proj + cols.q, cols.ld, seg.row, i, 2 * pair + e, history, D, conv.ck);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        q[e] = ConvOf(taps[e], 2 * pair + e, conv.q_weight, conv.q_bias, conv.ck);
        k[e] = ConvOf(taps[e], 2 * pair + e, conv.k_weight, conv.k_bias, conv.ck);
      }
      if (rewrite_history && live) {
#pragma unroll
        for (int e = 0; e < 2; ++e) ShiftHistory(history, D, conv.ck, 2 * pair + e, taps[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        q[e] = in[cols.q + 2 * pair + e];
        k[e] = in[cols.k + 2 * pair + e];
      }
    }
    RotatePair(q[0], q[1], cos_sin);
    RotatePair(k[0], k[1], cos_sin);
    q_out[out + 2 * pair] = q[0];
    q_out[out + 2 * pair + 1] = q[1];
    k_out[out + 2 * pair] = k[0];
    k_out[out + 2 * pair + 1] = k[1];
  }
  for (int c = threadIdx.x; c < D; c += blockDim.x) v_out[out + c] = in[cols.v + c];
  for (int h = threadIdx.x; h < nh; h += blockDim.x) {
    lr_out[static_cast<int64_t>(row) * nh + h] =
        base_lr / (1.0f + expf(-(in[cols.lr + h] + lr_bias[h]))) / f;
  }
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

cudaError_t AdvanceConvHistory(const float* x, int64_t ld, int num_segments, int D, int ck,
                               const Segment* segments, StateAddress state, size_t history_offset,
                               cudaStream_t stream) {
  if (ck - 1 > kMaxHistory) return cudaErrorInvalidValue;
  if (num_segments == 0 || ck == 1) return cudaSuccess;
  AdvanceHistoryKernel<<<num_segments, kThreads, 0, stream>>>(x, ld, D, ck, segments, state,
                                                              history_offset);
  return cudaGetLastError();
}

cudaError_t PreConvDecode(float* h, int rows, int D, const float* norm_weight, float eps,
                          const float* conv_weight, const float* conv_bias, int ck,
                          const Segment* segments, StateAddress state, size_t history_offset,
                          cudaStream_t stream) {
  if (ck - 1 > kMaxHistory) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int threads = std::min(1024, RoundUpToWarp(D));
  auto* kernel =
      ck <= kCommonTaps ? PreConvDecodeKernel<kCommonTaps> : PreConvDecodeKernel<kMaxTaps>;
  kernel<<<rows, threads, 0, stream>>>(h, D, norm_weight, eps, conv_weight, conv_bias, ck, segments,
                                       state, history_offset);
  return cudaGetLastError();
}

cudaError_t PrepareTttInputs(const float* proj, ProjectionColumns columns, int rows, int nh, int f,
                             int K, const float2* rope, const QkConv* conv, const float* lr_bias,
                             float base_lr, const Segment* segments, const int32_t* row_segment,
                             StateAddress state, bool rewrite_history, float* q, float* k, float* v,
                             float* lr, cudaStream_t stream) {
  if (f % 2 != 0 || (conv != nullptr && conv->ck - 1 > kMaxHistory)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  // A thread per channel pair, up to a block size that leaves each thread registers enough to
  // issue all of its loads together.
  const int threads = std::min(kPrepareThreads, RoundUpToWarp(nh * f / 2));
  auto* kernel = conv == nullptr || conv->ck <= kCommonTaps ? PrepareTttInputsKernel<kCommonTaps>
                                                            : PrepareTttInputsKernel<kMaxTaps>;
  kernel<<<rows, threads, 0, stream>>>(
      proj, columns, nh, f, K, rope, conv != nullptr ? *conv : QkConv{}, conv != nullptr, lr_bias,
      base_lr, segments, row_segment, state, rewrite_history, q, k, v, lr);
  return cudaGetLastError();
}

}  // namespace ttt::kernels::cuda
