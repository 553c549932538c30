// The TTT layer's input transforms, a channel at a time, shared by the kernels that compute them
// (the pre-conv, PrepareTttInputs, the decode TTT kernel): causal depthwise convs over a
// sequence's rows and its history (a tap's inputs, their weighted sum, the history's next row),
// RoPE's rotation and the inner step size.
#pragma once

#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {

constexpr int kMaxHistory = 8;  // ck ≤ 9 (checked by the launchers).
// Taps held per channel: kernels come in two sizes, for ck ≤ 4 (every known model) with few
// registers, and for any ck up to 9.
constexpr int kCommonTaps = 4, kMaxTaps = kMaxHistory + 1;

// A conv's history ([h, D], h = ck − 1) is a ring of the sequence's last h inputs: the input at
// position s (its index from the sequence's start) is row s mod h. A token then adds its input
// by writing one row, over the oldest; shifting the rows wrote all h, which cost a 1b decode
// step ~2% (bench/README.md v38). Rows of positions before the start are zero (a fresh state's).
// Saved states hold the rows oldest first (server/engine/state_layout.h, RingConvHistories).
__device__ __forceinline__ int HistoryRow(int64_t position, int h) {
  // Every known model has h = 3: a 64-bit modulo by a constant is a multiplication, by a variable
  // a division (tens of instructions in kernels of a block a row).
  const int row = static_cast<int>(h == 3 ? position % 3 : position % h);
  return row < 0 ? row + h : row;
}

// The inputs of a causal conv's taps at channel c for row i of a segment: tap j reads segment
// row i − h + j, or before the segment's first row the history (nullptr: zeros), whose row
// `oldest` = HistoryRow(segment start, h) holds the input h rows before the segment. All loads
// are issued before any is used.
template <int kTaps>
struct Taps {
  float in[kTaps];
};

template <int kTaps>
__device__ __forceinline__ Taps<kTaps> LoadTaps(const float* x, int64_t ld, int first_row, int i,
                                                int c, const float* history, int oldest, int D,
                                                int ck) {
  const int h = ck - 1;
  Taps<kTaps> taps;
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j < ck) {
      const int s = i - h + j;
      // Before the segment (−h ≤ s < 0): row (oldest + s) mod h.
      const int row = oldest + s >= 0 ? oldest + s : oldest + s + h;
      // One load from either address (not a branch a source), so that the loads of a thread's
      // further channels can be issued beside it.
      const float* input =
          s >= 0 ? x + static_cast<int64_t>(first_row + s) * ld + c : history + row * D + c;
      taps.in[j] = s >= 0 || history != nullptr ? *input : 0.0f;
    }
  }
  return taps;
}

// The taps of a one-row segment at position t: the history's inputs at t − h .. t − 1, from
// row `oldest` = HistoryRow(t, h) on around the ring, then `current` (tap ck−1).
template <int kTaps>
__device__ __forceinline__ Taps<kTaps> DecodeTaps(const float* history, int oldest, int D, int c,
                                                  int ck, float current) {
  Taps<kTaps> taps;
  const int h = ck - 1;
  int row = oldest;
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j + 1 < ck) {
      taps.in[j] = history != nullptr ? history[row * D + c] : 0.0f;
      row = row + 1 == h ? 0 : row + 1;
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

// For a segment of one row: its input (tap ck−1) takes the oldest input's row (DecodeTaps).
// The tap is selected over an unrolled loop: indexing taps.in by the run-time ck − 1 would put
// the taps on the stack.
template <int kTaps>
__device__ __forceinline__ void AppendToHistory(float* history, int oldest, int D, int ck, int c,
                                                const Taps<kTaps>& taps) {
  if (ck <= 1) return;
  float input = taps.in[0];
#pragma unroll
  for (int j = 1; j < kTaps; ++j) input = j == ck - 1 ? taps.in[j] : input;
  history[oldest * D + c] = input;
}

// Four adjacent channels c .. c + 3 (c % 4 == 0) of a conv with exactly four taps (every known
// model), where every row read is one 16-byte load: the history's three rows and the token's own
// input become each channel's taps, and each channel's four weights are one load.
__device__ __forceinline__ float4 Load4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float Channel(const float4& v, int i) {
  return reinterpret_cast<const float*>(&v)[i];  // i is a constant once unrolled: a register.
}

// The channels' three earlier inputs, oldest first, from the history's ring (row `oldest` on, as
// DecodeTaps).
struct FourChannelHistory {
  float4 rows[3];
};

__device__ __forceinline__ FourChannelHistory LoadFourChannelHistory(const float* history,
                                                                     int oldest, int D, int c) {
  const int next = oldest == 2 ? 0 : oldest + 1, newest = next == 2 ? 0 : next + 1;
  return {{Load4(history + oldest * D + c), Load4(history + next * D + c),
           Load4(history + newest * D + c)}};
}

__device__ __forceinline__ void FourChannelTaps(const FourChannelHistory& history, float4 current,
                                                Taps<4> taps[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    taps[i].in[0] = Channel(history.rows[0], i);
    taps[i].in[1] = Channel(history.rows[1], i);
    taps[i].in[2] = Channel(history.rows[2], i);
    taps[i].in[3] = Channel(current, i);
  }
}

__device__ __forceinline__ void FourChannelDecodeTaps(const float* history, int oldest, int D,
                                                      int c, float4 current, Taps<4> taps[4]) {
  FourChannelTaps(LoadFourChannelHistory(history, oldest, D, c), current, taps);
}

// The conv's bias and weights for the four channels c .. c + 3.
struct FourChannelConvWeights {
  float4 bias;
  float4 weights[4];  // Channel c + i's four taps.
};

__device__ __forceinline__ FourChannelConvWeights LoadFourChannelConv(const float* w,
                                                                      const float* b, int c) {
  FourChannelConvWeights conv;
  conv.bias = Load4(b + c);
#pragma unroll
  for (int i = 0; i < 4; ++i) conv.weights[i] = Load4(w + (c + i) * 4);
  return conv;
}

// ConvOf for the four channels, in the same order of operations.
__device__ __forceinline__ void FourChannelConv(const Taps<4> taps[4],
                                                const FourChannelConvWeights& conv, float out[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float acc = Channel(conv.bias, i);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc += Channel(conv.weights[i], j) * taps[i].in[j];
    out[i] = acc;
  }
}

__device__ __forceinline__ void FourChannelConv(const Taps<4> taps[4], int c, const float* w,
                                                const float* b, float out[4]) {
  FourChannelConv(taps, LoadFourChannelConv(w, b, c), out);
}

// AppendToHistory for the four channels: their inputs (tap 3) take the oldest row.
__device__ __forceinline__ void FourChannelAppendToHistory(float* history, int oldest, int D, int c,
                                                           const Taps<4> taps[4]) {
  *reinterpret_cast<float4*>(history + oldest * D + c) =
      make_float4(taps[0].in[3], taps[1].in[3], taps[2].in[3], taps[3].in[3]);
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
