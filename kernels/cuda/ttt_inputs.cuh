// The TTT layer's input transforms, a channel at a time, shared by the kernels that compute them
// (the pre-conv, PrepareTttInputs, the decode TTT kernel): causal depthwise convs over a
// sequence's rows and its history (a tap's inputs, their weighted sum, the history's shift),
// RoPE's rotation and the inner step size.
#pragma once

#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {

constexpr int kMaxHistory = 8;  // ck ≤ 9 (checked by the launchers).
// Taps held per channel: kernels come in two sizes, for ck ≤ 4 (every known model) with few
// registers, and for any ck up to 9.
constexpr int kCommonTaps = 4, kMaxTaps = kMaxHistory + 1;
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

// RoPE: channels (a, b) = (2i, 2i + 1) rotated by the angle of (cos, sin).
__device__ __forceinline__ void RotatePair(float& a, float& b, float2 cos_sin) {
  const float x = a, y = b;
  a = x * cos_sin.x - y * cos_sin.y;
  b = y * cos_sin.x + x * cos_sin.y;
}

// A head's inner step size (spec §3.4): base_lr · sigmoid(x·w_lr + bias) / f.
__device__ __forceinline__ float InnerStepSize(float projected, float bias, float base_lr, int f) {
  return base_lr / (1.0f + expf(-(projected + bias))) / f;
}

}  // namespace ttt::kernels::cuda
