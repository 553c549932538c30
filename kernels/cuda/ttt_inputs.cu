// The TTT layer's per-sequence inputs: causal convs with their histories, RoPE, inner step sizes.
#include <algorithm>

#include "kernels/cuda/ttt_inputs.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kPrepareThreads = 512;

// One block per row, its threads and their elements as RmsNormKernel's (so y is as RmsNorm writes
// it): h += the conv of x over the row's segment, then y = RMSNorm(h). A thread's every load goes
// out before its first store to h: nothing tells the compiler that h is apart from x and the
// history, so a store between two elements would hold the next element's loads back by a round
// trip each (8.4 µs a 125m layer with four elements a thread, bench/README.md v73). kSlice: the
// elements a thread holds, four where RowThreads gives no thread more (rows up to 4,096, every
// known model). Wider rows' eight elements store each as it is computed: all their loads at once
// would spill.
template <int kTaps, int kSlice>
__global__ void __launch_bounds__(1024)
    PreConvRowsKernel(const float* x, int D, const float* w, const float* b, int ck,
                      const Segment* segments, const int32_t* row_segment, StateAddress state,
                      size_t history_offset, float* h, float eps, const float* next_norm_w, void* y,
                      ElementType y_type, bool skip_one_row_segments) {
  __shared__ float scratch[kWarp];
  const int row = blockIdx.x;
  // The step's segments and the weights are written by no kernel of the step: they are read
  // while the previous kernel ends.
  const Segment seg = segments[row_segment[row]];
  const bool skipped = skip_one_row_segments && seg.count == 1;
#pragma unroll
  for (int m = 0; m < kSlice; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    if (!skipped && c < D) {
      PrefetchToL1(w + c * ck);
      PrefetchToL1(b + c);
      PrefetchToL1(next_norm_w + c);
    }
  }
  WaitForPreviousKernel();
  if (skipped) return;
  const float* history = SequenceState(state, seg.slot) + history_offset;
  const int oldest = ck > 1 ? HistoryRow(seg.start, ck - 1) : 0;
  const int64_t base = static_cast<int64_t>(row) * D;
  constexpr bool kStoreAsComputed = kSlice > 4;
  float v[kSlice], sum = 0;
#pragma unroll
  for (int m = 0; m < kSlice; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    v[m] = 0.0f;
    if (c < D) {
      const Taps<kTaps> taps =
          LoadTaps<kTaps>(x, D, seg.row, row - seg.row, c, history, oldest, D, ck);
      v[m] = h[base + c] + ConvOf(taps, c, w, b, ck);
      if constexpr (kStoreAsComputed) h[base + c] = v[m];
    }
    sum += v[m] * v[m];
  }
#pragma unroll
  for (int m = 0; m < kSlice && !kStoreAsComputed; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    if (c < D) h[base + c] = v[m];
  }
  const float inv_rms = rsqrtf(BlockSum(sum, scratch) / D + eps);
  StoreNormedSlice(y, y_type, base, D, v, inv_rms, [&](int, int c) { return next_norm_w[c]; });
}

// One block per segment: its last ck−1 rows (all of them, if fewer) take their rows of the
// history's ring; the inputs before the segment keep theirs. A thread a channel, up to 1,024: a
// thread's stores hold back the loads of its next channel.
__global__ void AdvanceHistoryKernel(const float* x, int64_t ld, int D, int ck,
                                     const Segment* segments, StateAddress state,
                                     size_t history_offset) {
  WaitForPreviousKernel();
  const Segment seg = segments[blockIdx.x];
  if (seg.count == 0) return;
  float* history = SequenceState(state, seg.slot) + history_offset;
  const int h = ck - 1, kept = min(seg.count, h), first = seg.count - kept;
  const int first_row = HistoryRow(seg.start + first, h);
  const float* rows = x + static_cast<int64_t>(seg.row + first) * ld;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    // All of a channel's loads before its stores, in registers (unrolled to constant indices).
    float values[kMaxHistory];
#pragma unroll
    for (int r = 0; r < kMaxHistory; ++r) values[r] = r < kept ? rows[r * ld + c] : 0.0f;
#pragma unroll
    for (int r = 0, row = first_row; r < kMaxHistory; ++r, row = row + 1 == h ? 0 : row + 1) {
      if (r < kept) history[row * D + c] = values[r];
    }
  }
}

// One block per segment of at most one row (row b, or the segment's own row with
// `segment_rows`): RMSNorm, conv over the history, residual, then the next RMSNorm of the new
// row. The row stays in registers (as RmsNormKernel).
template <int kTaps>
__global__ void __launch_bounds__(1024)
    PreConvDecodeKernel(float* h, int D, const float* norm_w, float eps, const float* w,
                        const float* b, int ck, const Segment* segments, bool segment_rows,
                        StateAddress state, size_t history_offset, const float* next_norm_w,
                        void* y, ElementType y_type) {
  __shared__ float scratch[kWarp];
  const Segment seg = segments[blockIdx.x];
  const bool live = seg.count > 0;
  if (segment_rows && !live) return;
  const int64_t base = static_cast<int64_t>(segment_rows ? seg.row : blockIdx.x) * D;
  float* history = live ? SequenceState(state, seg.slot) + history_offset : nullptr;
  const int oldest = ck > 1 ? HistoryRow(seg.start, ck - 1) : 0;
  // What the conv and the next norm read after the first reduction is on its way while the
  // previous kernel ends (at batch 1 these are DRAM reads: the step's weights have streamed
  // through L2 since). The history is written by this kernel alone.
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    if (c < D) {
      PrefetchToL1(norm_w + c);
      PrefetchToL1(w + c * ck);
      PrefetchToL1(b + c);
      PrefetchToL1(next_norm_w + c);
      for (int j = 0; live && j + 1 < ck; ++j) PrefetchToL1(history + j * D + c);
    }
  }
  WaitForPreviousKernel();
  float v[kRowSlice], sum = 0;
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    v[m] = c < D ? h[base + c] : 0.0f;
    sum += v[m] * v[m];
  }
  const float inv_rms = rsqrtf(BlockSum(sum, scratch) / D + eps);
  float next_sum = 0;
  // Unrolled, every tap of the row's slice is loaded at once: at the largest kernels that is more
  // than the registers a 1,024-thread block has.
#pragma unroll(kTaps == kCommonTaps ? kRowSlice : 1)
  for (int m = 0; m < kRowSlice; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    if (c < D) {
      const Taps<kTaps> taps =
          DecodeTaps<kTaps>(history, oldest, D, c, ck, v[m] * inv_rms * norm_w[c]);
      v[m] += ConvOf(taps, c, w, b, ck);
      h[base + c] = v[m];
      if (live) AppendToHistory(history, oldest, D, ck, c, taps);
      next_sum += v[m] * v[m];
    }
  }
  const float next_inv_rms = rsqrtf(BlockSum(next_sum, scratch) / D + eps);
  StoreNormedSlice(y, y_type, base, D, v, next_inv_rms, [&](int, int c) { return next_norm_w[c]; });
}

// PreConvDecodeKernel for a conv of exactly four taps over rows of whole channel quads, 16-byte
// aligned (every known model): thread t owns channels 4t .. 4t + 3, and holds in registers,
// loaded before the previous kernel ends, all it reads but the row: the history, the conv's and
// the norms' weights. (L1 prefetches of them, as the general form issues, are evicted before
// use once several blocks share an SM: ~80 KB a block at d = 2048.) Each element takes the
// general form's order of operations; only the row sums add in another order.
__global__ void __launch_bounds__(1024)
    PreConvDecodeFourTapsKernel(float* h, int D, const float* norm_w, float eps, const float* w,
                                const float* b, const Segment* segments, bool segment_rows,
                                StateAddress state, size_t history_offset,
                                const float* next_norm_w, void* y, ElementType y_type) {
  __shared__ float scratch[kWarp];
  const Segment seg = segments[blockIdx.x];
  const bool live = seg.count > 0;
  if (segment_rows && !live) return;
  const int64_t base = static_cast<int64_t>(segment_rows ? seg.row : blockIdx.x) * D;
  float* history = live ? SequenceState(state, seg.slot) + history_offset : nullptr;
  const int c = 4 * threadIdx.x, oldest = HistoryRow(seg.start, 3);
  const bool owner = c < D;
  FourChannelHistory earlier{};
  FourChannelConvWeights conv{};
  float4 gain{}, next_gain{};
  if (owner) {
    if (live) earlier = LoadFourChannelHistory(history, oldest, D, c);
    conv = LoadFourChannelConv(w, b, c);
    gain = Load4(norm_w + c);
    next_gain = Load4(next_norm_w + c);
  }
  WaitForPreviousKernel();
  float4 v = owner ? Load4(h + base + c) : Broadcast4(0.0f);
  const float inv_rms = rsqrtf(BlockSum(Dot4(v, v), scratch) / D + eps);
  if (owner) {
    Taps<4> taps[4];
    FourChannelTaps(earlier, (inv_rms * v) * gain, taps);
    float convolved[4];
    FourChannelConv(taps, conv, convolved);
    v = v + make_float4(convolved[0], convolved[1], convolved[2], convolved[3]);
    *reinterpret_cast<float4*>(h + base + c) = v;
    if (live) FourChannelAppendToHistory(history, oldest, D, c, taps);
  }
  const float next_inv_rms = rsqrtf(BlockSum(Dot4(v, v), scratch) / D + eps);
  if (owner) {
    const float4 normed = (next_inv_rms * v) * next_gain;
#pragma unroll
    for (int i = 0; i < 4; ++i) Store(y, base + c + i, Channel(normed, i), y_type);
  }
}

// One block per row; thread t handles the channel pairs (2t, 2t+1) that RoPE rotates together.
template <int kTaps>
__global__ void __launch_bounds__(kPrepareThreads)
    PrepareTttInputsKernel(TttProjectionInputs inputs, int nh, int f, int K,
                           const Segment* segments, const int32_t* row_segment, StateAddress state,
                           bool rewrite_history, bool skip_one_row_segments, float* q_out,
                           float* k_out, float* v_out, float* lr_out) {
  WaitForPreviousKernel();
  const ProjectionColumns& cols = inputs.columns;
  const QkConv& conv = inputs.conv;
  const int row = blockIdx.x;
  const Segment seg = segments[row_segment[row]];
  if (skip_one_row_segments && seg.count == 1) return;
  const int i = row - seg.row;
  const bool live = i < seg.count;  // Padding rows of a decode graph compute on zero history.
  const int p = live ? static_cast<int>((seg.start + i) % K) : 0;
  const int D = nh * f;
  const float* in = inputs.proj + static_cast<int64_t>(row) * cols.ld;
  float* history =
      inputs.share_qk && live ? SequenceState(state, seg.slot) + conv.history_offset : nullptr;
  // The ring's row of the input h rows before the segment (LoadTaps); with rewrite_history
  // (segments of one row) the row this row's input replaces.
  const int oldest = history != nullptr && conv.ck > 1 ? HistoryRow(seg.start, conv.ck - 1) : 0;
  const int64_t out = static_cast<int64_t>(row) * D;
  // Every load before the first store, which would hold back the loads after it (the compiler
  // cannot tell the outputs from the inputs): the first head's step-size input here, v's
  // channels with their pair's.
  const bool first_head = threadIdx.x < nh;
  const float first_lr_input = first_head ? in[cols.lr + threadIdx.x] : 0.0f;
  const float first_lr_bias = first_head ? inputs.lr_bias[threadIdx.x] : 0.0f;
  for (int pair = threadIdx.x; pair < D / 2; pair += blockDim.x) {
    // Loads first (both channels), then arithmetic, then the history's rewrite.
    const float2 cos_sin = inputs.rope[p * (f / 2) + pair % (f / 2)];
    const float v[2] = {in[cols.v + 2 * pair], in[cols.v + 2 * pair + 1]};
    float q[2], k[2];
    if (inputs.share_qk) {
      Taps<kTaps> taps[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        taps[e] = LoadTaps<kTaps>(inputs.proj + cols.q, cols.ld, seg.row, i, 2 * pair + e, history,
                                  oldest, D, conv.ck);
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        q[e] = ConvOf(taps[e], 2 * pair + e, conv.q_weight, conv.q_bias, conv.ck);
        k[e] = ConvOf(taps[e], 2 * pair + e, conv.k_weight, conv.k_bias, conv.ck);
      }
      if (rewrite_history && live) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          AppendToHistory(history, oldest, D, conv.ck, 2 * pair + e, taps[e]);
        }
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
    v_out[out + 2 * pair] = v[0];
    v_out[out + 2 * pair + 1] = v[1];
  }
  for (int h = threadIdx.x; h < nh; h += blockDim.x) {
    const bool first = h == threadIdx.x;
    lr_out[static_cast<int64_t>(row) * nh + h] =
        InnerStepSize(first ? first_lr_input : in[cols.lr + h],
                      first ? first_lr_bias : inputs.lr_bias[h], inputs.base_lr, f);
  }
}

}  // namespace

cudaError_t PreConvRows(const float* x, int rows, int D, const float* conv_weight,
                        const float* conv_bias, int ck, const Segment* segments,
                        const int32_t* row_segment, StateAddress state, size_t history_offset,
                        float* h, float eps, const float* next_norm_weight, void* y,
                        ElementType y_type, bool skip_one_row_segments, cudaStream_t stream) {
  if (D > kMaxRowWidth || ck > kMaxTaps) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  auto* kernel = D > 4 * 1024        ? PreConvRowsKernel<kMaxTaps, kRowSlice>
                 : ck <= kCommonTaps ? PreConvRowsKernel<kCommonTaps, 4>
                                     : PreConvRowsKernel<kMaxTaps, 4>;
  return Launch(kernel, rows, RowThreads(D), 0, stream, x, D, conv_weight, conv_bias, ck, segments,
                row_segment, state, history_offset, h, eps, next_norm_weight, y, y_type,
                skip_one_row_segments);
}

cudaError_t AdvanceConvHistory(const float* x, int64_t ld, int num_segments, int D, int ck,
                               const Segment* segments, StateAddress state, size_t history_offset,
                               cudaStream_t stream) {
  if (ck - 1 > kMaxHistory) return cudaErrorInvalidValue;
  if (num_segments == 0 || ck == 1) return cudaSuccess;
  return Launch(AdvanceHistoryKernel, num_segments, std::min(1024, RoundUpToWarp(D)), 0, stream, x,
                ld, D, ck, segments, state, history_offset);
}

cudaError_t PreConvDecode(float* h, int num_segments, bool segment_rows, int D,
                          const float* norm_weight, float eps, const float* conv_weight,
                          const float* conv_bias, int ck, const Segment* segments,
                          StateAddress state, size_t history_offset,
                          const float* next_norm_weight, void* y, ElementType y_type,
                          cudaStream_t stream) {
  if (ck - 1 > kMaxHistory || D > kMaxRowWidth) return cudaErrorInvalidValue;
  if (num_segments == 0) return cudaSuccess;
  const bool quads = ck == 4 && D % 4 == 0 && D / 4 <= 1024 && history_offset % 4 == 0 &&
                     Aligned16(state.states) && state.slot_floats % 4 == 0 &&
                     state.layer_offset % 4 == 0 && Aligned16(h) && Aligned16(norm_weight) &&
                     Aligned16(conv_weight) && Aligned16(conv_bias) && Aligned16(next_norm_weight);
  if (quads) {
    // in_proj's product follows, with ~200 KB of shared memory a block at batch 256: its blocks
    // start beside this kernel's last ones only if both ask for the same carveout (as
    // PostNormGate does before o_proj).
    static const cudaError_t carveout =
        cudaFuncSetAttribute(PreConvDecodeFourTapsKernel,
                             cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
    if (carveout != cudaSuccess) return carveout;
    return Launch(PreConvDecodeFourTapsKernel, num_segments, RoundUpToWarp(D / 4), 0, stream, h,
                  D, norm_weight, eps, conv_weight, conv_bias, segments, segment_rows, state,
                  history_offset, next_norm_weight, y, y_type);
  }
  auto* kernel =
      ck <= kCommonTaps ? PreConvDecodeKernel<kCommonTaps> : PreConvDecodeKernel<kMaxTaps>;
  return Launch(kernel, num_segments, RowThreads(D), 0, stream, h, D, norm_weight, eps, conv_weight,
                conv_bias, ck, segments, segment_rows, state, history_offset, next_norm_weight, y,
                y_type);
}

cudaError_t PrepareTttInputs(const TttProjectionInputs& inputs, int rows, int nh, int f, int K,
                             const Segment* segments, const int32_t* row_segment,
                             StateAddress state, bool rewrite_history, bool skip_one_row_segments,
                             float* q, float* k, float* v, float* lr, cudaStream_t stream) {
  if (f % 2 != 0 || (inputs.share_qk && inputs.conv.ck - 1 > kMaxHistory)) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  // A thread per channel pair, up to a block size that leaves each thread registers enough to
  // issue all of its loads together.
  const int threads = std::min(kPrepareThreads, RoundUpToWarp(nh * f / 2));
  auto* kernel = !inputs.share_qk || inputs.conv.ck <= kCommonTaps
                     ? PrepareTttInputsKernel<kCommonTaps>
                     : PrepareTttInputsKernel<kMaxTaps>;
  return Launch(kernel, rows, threads, 0, stream, inputs, nh, f, K, segments, row_segment, state,
                rewrite_history, skip_one_row_segments, q, k, v, lr);
}

}  // namespace ttt::kernels::cuda
