// The TTT inner loop on the GPU: one block per (sequence, head), tokens in order.
//
// Each token: its gradient at θ0 joins the window's pending tokens (kept in the state, so a
// sequence can stop and resume anywhere), its output is the dual-form row over the window's tokens
// up to itself, and after a window's last token θ0 is rewritten.
//
// Three kernels. The general one (any number of tokens, TTT-Linear and TTT-MLP; TTT-MLP's decode
// too): thread c owns column c of W1, and TTT-MLP's passes over W2 [f1, f] share its rows among
// all threads, so each pass over θ0 reads every weight once, coalesced; θ0 stays in device memory
// (L1/L2-cached) across tokens. The decode one (TTT-Linear, one token per sequence, the hot path
// of serving) is a warp per (sequence, head) that reads its inputs from the projection itself and
// copies θ0 to shared memory asynchronously, so that all of it is in flight at once; its warps are
// persistent, each copying its next item's θ0 while it computes one. The prefill one
// (TTT-Linear, K = 16) takes a window's tokens at once in the dual form.
#include <cuda_pipeline.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "kernels/cuda/ttt_decode.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kMaxK = 64;  // Mini-batch sizes up to this (16 in every known model).

struct SharedScratch {
  float reduce[kWarp];
  float coef[kMaxK];
};

// ∂/∂z of ½‖LN(z) − target‖² for the value z of this thread (active threads only hold values;
// the others pass active = false). Also returns LN(z) via *normalized.
__device__ float LayerNormL2Gradient(float z, float target, bool active, int f, float gamma,
                                     float beta, float eps, float* scratch, float* normalized) {
  const float mean = BlockSum(active ? z : 0.0f, scratch) / f;
  const float centered = active ? z - mean : 0.0f;
  const float var = BlockSum(centered * centered, scratch) / f;
  const float inv_std = rsqrtf(var + eps);
  const float xhat = centered * inv_std;
  *normalized = gamma * xhat + beta;
  const float e = active ? gamma * (*normalized - target) : 0.0f;
  const float sum_e = BlockSum(e, scratch);
  const float sum_e_xhat = BlockSum(e * xhat, scratch);
  return (f * e - sum_e - xhat * sum_e_xhat) * inv_std / f;
}

__device__ float LayerNormOf(float z, bool active, int f, float gamma, float beta, float eps,
                             float* scratch) {
  const float mean = BlockSum(active ? z : 0.0f, scratch) / f;
  const float centered = active ? z - mean : 0.0f;
  const float var = BlockSum(centered * centered, scratch) / f;
  return gamma * centered * rsqrtf(var + eps) + beta;
}

// coef[j] = τ_r · lr_j · (a · b_j + 1) for j ≤ r, where b_j are rows of `rows` [K, width].
__device__ void DualCoefficients(const float* a, const float* rows, int width, int r, float tau_r,
                                 const float* lr, float* coef) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int j = warp; j <= r; j += blockDim.x / kWarp) {
    float dot = 0;
    for (int d = lane; d < width; d += kWarp) dot += a[d] * rows[j * width + d];
    dot = WarpSum(dot);
    if (lane == 0) coef[j] = tau_r * lr[j] * (dot + 1.0f);
  }
}

// Σ_d a[d] · W[d, c] over W's `rows` for each column c < width of W [rows, width], all of the
// block's threads taking part: with parts = blockDim.x / width, thread t sums column t % width
// over rows t / width, t / width + parts, …, and thread c < width adds the parts (through
// `partial`, blockDim.x floats of shared memory) and returns the sum; the others return 0. At
// TTT-MLP's second layer (width f, rows 4f) a thread per column alone would walk 4f rows with
// three quarters of the block idle.
__device__ float RowsTimesMatrix(const float* a, const float* W, int rows, int width,
                                 float* partial) {
  const int t = threadIdx.x, parts = blockDim.x / width, column = t % width, part = t / width;
  float sum = 0;
  if (part < parts) {
#pragma unroll 16
    for (int d = part; d < rows; d += parts) sum += a[d] * W[d * width + column];
  }
  partial[t] = sum;
  __syncthreads();
  float total = 0;
  if (t < width) {
    for (int i = 0; i < parts; ++i) total += partial[i * width + t];
  }
  __syncthreads();  // `partial` may be written again.
  return total;
}

// W [rows, width] times the column v [width], into out [rows] (shared): each warp takes
// kRowsAtOnce rows at a time, its lanes reading each row's consecutive elements (a thread a row
// would read with a stride of `width`, a sector per element), all of those rows' loads in flight
// together (a row at a time, each row's sum would wait for its loads).
__device__ void MatrixTimesColumn(const float* __restrict__ W, int rows, int width,
                                  const float* __restrict__ v, float* __restrict__ out) {
  constexpr int kRowsAtOnce = 16;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  for (int d0 = warp * kRowsAtOnce; d0 < rows; d0 += blockDim.x / kWarp * kRowsAtOnce) {
    float dot[kRowsAtOnce] = {};
    for (int e = lane; e < width; e += kWarp) {
      float w[kRowsAtOnce];
#pragma unroll
      for (int i = 0; i < kRowsAtOnce; ++i) w[i] = d0 + i < rows ? W[(d0 + i) * width + e] : 0.0f;
      const float v_e = v[e];
#pragma unroll
      for (int i = 0; i < kRowsAtOnce; ++i) dot[i] += v_e * w[i];
    }
#pragma unroll
    for (int i = 0; i < kRowsAtOnce; ++i) {
      const float sum = WarpSum(dot[i]);
      if (lane == 0 && d0 + i < rows) out[d0 + i] = sum;
    }
  }
}

// Threads of TttScanKernel: a block's are a thread per column of W1 (f1 ≤ 1,024).
constexpr int kMaxScanThreads = 1024;

__global__ void __launch_bounds__(kMaxScanThreads)
    TttScanKernel(TttScanParams p, const Segment* segments, const float* q_all, const float* k_all,
                  const float* v_all, const float* lr_all, StateAddress state, TttStateOffsets off,
                  float* out_all) {
  WaitForPreviousKernel();
  extern __shared__ float dynamic[];
  __shared__ SharedScratch shared;
  const int f = p.f, f1 = p.f1, K = p.K, nh = p.nh, D = nh * f;
  float* q = dynamic;      // [f]
  float* k = q + f;        // [f]
  float* x2bar = k + f;    // [f1] (mlp)
  float* x2 = x2bar + f1;  // [f1] (mlp)
  float* g2 = x2 + f1;     // [f] (mlp)
  float* staged = g2 + f;  // [K, f + f1]: a window's pending rows, staged for the commit.
  float* partial = staged + K * (f + f1);  // [blockDim.x]: RowsTimesMatrix's parts.

  const Segment seg = segments[blockIdx.x / nh];
  const int head = blockIdx.x % nh;
  float* base = SequenceState(state, seg.slot);
  float* W1 = base + off.W1 + static_cast<size_t>(head) * f * f1;
  // W1 in halves (TttStateOffsets::w1_split), or null.
  uint16_t* W1_upper = nullptr;
  uint16_t* W1_lower = nullptr;
  if (off.w1_split) {
    W1_upper = reinterpret_cast<uint16_t*>(base + off.W1) + static_cast<size_t>(head) * f * f1;
    W1_lower = W1_upper + static_cast<size_t>(nh) * f * f1;
  }
  float* b1 = base + off.b1 + head * f1;
  float* W2 = base + off.W2 + static_cast<size_t>(head) * f1 * f;
  float* b2 = base + off.b2 + head * f;
  float* pk = base + off.k + head * K * f;
  float* pg1 = base + off.g1 + head * K * f1;
  float* plr = base + off.lr + head * K;
  float* px2 = base + off.x2 + head * K * f1;
  float* pg2 = base + off.g2 + head * K * f;

  const int c = threadIdx.x;
  const bool in_f = c < f, in_f1 = c < f1;
  const float gamma = in_f ? p.ln_weight[head * f + c] : 0.0f;
  const float beta = in_f ? p.ln_bias[head * f + c] : 0.0f;

  for (int i = 0; i < seg.count; ++i) {
    const int64_t row = seg.row + i;
    const int r = static_cast<int>((seg.start + i) % K);
    const int64_t at = row * D + head * f;
    if (in_f) {
      q[c] = q_all[at + c];
      k[c] = k_all[at + c];
    }
    const float v_c = in_f ? v_all[at + c] : 0.0f;
    const float lr_t = lr_all[row * nh + head];
    __syncthreads();

    // z1 = k W1 + b1 and zq = q W1 + b1 in one pass over column c of W1.
    float z1 = 0, zq = 0;
    if (in_f1) {
      z1 = zq = b1[c];
#pragma unroll 16
      for (int d = 0; d < f; ++d) {
        const int at = d * f1 + c;
        const float w = W1_upper != nullptr ? JoinHalves(W1_upper[at], W1_lower[at]) : W1[at];
        z1 += k[d] * w;
        zq += q[d] * w;
      }
    }
    float zbar;  // The final layer's pre-LN output for this token (valid for c < f).
    if (!p.mlp) {
      float unused;
      const float target = in_f ? v_c - k[c] : 0.0f;
      const float g =
          LayerNormL2Gradient(z1, target, in_f, f, gamma, beta, p.ln_eps, shared.reduce, &unused);
      if (in_f) {
        pg1[r * f1 + c] = g;
        pk[r * f + c] = k[c];
      }
      if (c == 0) plr[r] = lr_t;
      __syncthreads();  // Pending rows visible to the whole block.
      DualCoefficients(q, pk, f, r, p.tau[r], plr, shared.coef);
      __syncthreads();
      zbar = zq;
      if (in_f) {
        for (int j = 0; j <= r; ++j) zbar -= shared.coef[j] * pg1[j * f1 + c];
      }
    } else {
      // Key side: x2 = gelu(z1), z2 = x2 W2 + b2, g2 at z2, g1 = (g2 W2ᵀ) ⊙ gelu′(z1).
      if (in_f1) x2[c] = Gelu(z1);
      __syncthreads();
      const float z2 = (in_f ? b2[c] : 0.0f) + RowsTimesMatrix(x2, W2, f1, f, partial);
      float unused;
      const float target = in_f ? v_c - k[c] : 0.0f;
      const float g2_c =
          LayerNormL2Gradient(z2, target, in_f, f, gamma, beta, p.ln_eps, shared.reduce, &unused);
      if (in_f) {
        g2[c] = g2_c;
        pg2[r * f + c] = g2_c;
        pk[r * f + c] = k[c];
      }
      if (in_f1) px2[r * f1 + c] = x2[c];
      if (c == 0) plr[r] = lr_t;
      __syncthreads();
      float* back = partial;  // [f1]: g2 W2ᵀ.
      MatrixTimesColumn(W2, f1, f, g2, back);
      __syncthreads();
      if (in_f1) pg1[r * f1 + c] = back[c] * GeluDerivative(z1);
      __syncthreads();
      // Query side, first layer.
      DualCoefficients(q, pk, f, r, p.tau[r], plr, shared.coef);
      __syncthreads();
      if (in_f1) {
        float zbar1 = zq;
#pragma unroll 8
        for (int j = 0; j <= r; ++j) zbar1 -= shared.coef[j] * pg1[j * f1 + c];
        x2bar[c] = Gelu(zbar1);
      }
      __syncthreads();
      // Second layer.
      DualCoefficients(x2bar, px2, f1, r, p.tau[r], plr, shared.coef);
      __syncthreads();
      zbar = RowsTimesMatrix(x2bar, W2, f1, f, partial);
      if (in_f) {
        zbar += b2[c];
#pragma unroll 8
        for (int j = 0; j <= r; ++j) zbar -= shared.coef[j] * pg2[j * f + c];
      }
    }
    const float normalized = LayerNormOf(zbar, in_f, f, gamma, beta, p.ln_eps, shared.reduce);
    if (in_f) out_all[at + c] = q[c] + normalized;

    // After the window's last token, θ0 takes the last token's θ̄: W −= Σ_j τ·lr_j · aⱼᵀ gⱼ for
    // each layer, with the window's rows staged in shared memory (left [K, width_a], scaled by
    // τ·lr_j, and right [K, width_g]). W is whole, or in halves where `upper` is not null.
    if (r == K - 1) {
      const float tau = p.tau[K - 1];
      auto commit = [&](const float* left, int left_width, const float* right, int right_width,
                        float* W, uint16_t* upper, uint16_t* lower, float* b) {
        float* a = staged;                   // [K, left_width]
        float* g = staged + K * left_width;  // [K, right_width]
        __syncthreads();
#pragma unroll 8
        for (int i = c; i < K * left_width; i += blockDim.x)
          a[i] = tau * plr[i / left_width] * left[i];
#pragma unroll 8
        for (int i = c; i < K * right_width; i += blockDim.x) g[i] = right[i];
        __syncthreads();
        // Every thread takes part, as in RowsTimesMatrix: column c % right_width, rows
        // c / right_width + parts · i, kRowsAtOnce of them loaded together (one at a time, each
        // row's update waited for its load).
        constexpr int kRowsAtOnce = 8;
        const int parts = blockDim.x / right_width, column = c % right_width;
        if (c < parts * right_width) {
          for (int d0 = c / right_width; d0 < left_width; d0 += kRowsAtOnce * parts) {
            float w[kRowsAtOnce];
#pragma unroll
            for (int i = 0; i < kRowsAtOnce; ++i) {
              const int d = d0 + i * parts;
              const int at = d * right_width + column;
              w[i] = d >= left_width    ? 0.0f
                     : upper != nullptr ? JoinHalves(upper[at], lower[at])
                                        : W[at];
            }
#pragma unroll
            for (int i = 0; i < kRowsAtOnce; ++i) {
              const int d = d0 + i * parts;
              if (d >= left_width) break;
              float update = 0;
              for (int j = 0; j < K; ++j) {
                update += a[j * left_width + d] * g[j * right_width + column];
              }
              const int at = d * right_width + column;
              if (upper != nullptr) {
                SplitHalves(w[i] - update, &upper[at], &lower[at]);
              } else {
                W[at] = w[i] - update;
              }
            }
          }
        }
        if (c < right_width) {
          float update = 0;
          for (int j = 0; j < K; ++j) update += tau * plr[j] * g[j * right_width + c];
          b[c] -= update;
        }
      };
      commit(pk, f, pg1, f1, W1, W1_upper, W1_lower, b1);            // W1 [f, f1]: keys, gradients.
      if (p.mlp) commit(px2, f1, pg2, f, W2, nullptr, nullptr, b2);  // W2 [f1, f]: x2, g2.
    }
    __syncthreads();  // θ0, pending rows and shared inputs settle before the next token.
  }
}

// A warp's place among a decode step's items: `item` = segment · nh + head. A warp walks items a
// grid apart, each step adding the grid's whole segments and heads and carrying the heads past nh:
// item / nh and item % nh were two integer divisions on the path to every item's first loads
// (bench/README.md v60).
struct DecodeItem {
  int item, segment, head;

  __device__ __forceinline__ void Next(int grid_segments, int grid_heads, int nh) {
    item += gridDim.x;
    segment += grid_segments;
    head += grid_heads;
    if (head >= nh) {
      head -= nh;
      ++segment;
    }
  }
};

// Decode, TTT-Linear: one token per sequence, a warp per (sequence, head) item running
// DecodeLinearToken (ttt_decode.cuh). The grid is persistent: each warp walks items a grid apart,
// and its next item's W1 is copied as soon as the current item releases its copy, so the copy
// overlaps the rest of the item and the next item's inputs. Without that a warp waited for every
// W1 with nothing to do, and the kernel moved its bytes at about half the memory bandwidth.

// The kernel comes in two register budgets, by the warps an SM it is bounded to. θ0's W1 in
// shared memory leaves room for 13 at f = 64, which put four on a quarter of the register file:
// 128 registers a warp. At 12, three a quarter, a warp may hold 168, and each item is faster
// (PlanDecodeGrid chooses; bench/README.md v39, v40). The kernel for other convs, which no known
// model has, is left unbounded rather than spill.
constexpr int kMostDecodeWarpsPerSm = 13, kRoomyDecodeWarpsPerSm = 12;

template <int kF, int kTaps, bool kSplit, int kWarpsPerSm>
__global__ void __launch_bounds__(kWarp, kTaps == kFourTaps ? kWarpsPerSm : 1)
    TttDecodeLinearKernel(TttScanParams p, TttProjectionInputs in, const Segment* segments,
                          int num_items, StateAddress state, TttStateOffsets off, float* out_all) {
  extern __shared__ float4 w1[];  // DecodeSharedBytes(kF)
  // Items are (segment, head), head fastest; a decode graph's batch bucket pads with empty
  // segments, which have nothing to compute.
  const int grid_segments = gridDim.x / p.nh, grid_heads = gridDim.x % p.nh;
  auto advance = [&](DecodeItem at) {
    at.Next(grid_segments, grid_heads, p.nh);
    return at;
  };
  auto next_live = [&](DecodeItem at) {
    while (at.item < num_items && segments[at.segment].count == 0) at = advance(at);
    return at;
  };
  auto segment_of = [&](const DecodeItem& at) {
    return at.item < num_items ? segments[at.segment] : Segment{};
  };
  // Starts copying W1 for `at`, whose segment segment() gives (called only for an item in range).
  auto copy_w1 = [&](const DecodeItem& at, auto segment) {
    if (at.item < num_items) {
      const bool commits = WindowPosition(segment(), p.K) == p.K - 1;
      CopyW1Async<kF, kSplit>(SequenceState(state, segment().slot), off, p.nh, at.head, commits,
                              w1);
    }
    __pipeline_commit();
  };
  auto commit = [&](const DecodeWindow& window, float4 bias) {
    CommitWindow<kF, kSplit>(p, window, w1, bias, /*warp=*/0, /*warps=*/1);
  };

  // The first item's W1 (state this kernel alone writes) is on its way before the previous
  // kernel, which writes the projection, ends. The loop over the items comes in two forms.
  const int first = static_cast<int>(blockIdx.x);
  DecodeItem item = next_live({first, first / p.nh, first % p.nh});
  if constexpr (kWarpsPerSm < kMostDecodeWarpsPerSm) {
    // With the roomier register budget, the next item's segment is asked for as an item starts
    // and first used where the item releases its W1 copy. Waited for at the loop's top, it put a
    // round trip to L2 before every item (bench/README.md v45).
    Segment seg = segment_of(item);
    copy_w1(item, [&] { return seg; });
    WaitForPreviousKernel();
    while (item.item < num_items) {
      DecodeItem next = advance(item);
      Segment next_seg = segment_of(next);
      WindowRows<kF> rows;
      DecodeLinearToken<kF, kTaps, kSplit>(
          p, in, seg, item.head, SequenceState(state, seg.slot), off, w1, out_all, rows, commit,
          [&] {
            if (next.item < num_items && next_seg.count == 0) {  // A batch bucket's padding.
              next = next_live(next);
              next_seg = segment_of(next);
            }
            copy_w1(next, [&] { return next_seg; });
          });
      item = next;
      seg = next_seg;
    }
  } else {
    // At 128 registers (13 warps an SM) the next segment held across an item spilled 20 bytes,
    // and 125m's steps were slower (v45), so this form waits for it at the loop's top. (Here the
    // walk's place spills 8 bytes; 125m's steps were faster with it than with two divisions, v60.)
    copy_w1(item, [&] { return segments[item.segment]; });
    WaitForPreviousKernel();
    while (item.item < num_items) {
      const DecodeItem next = next_live(advance(item));
      WindowRows<kF> rows;
      DecodeLinearToken<kF, kTaps, kSplit>(
          p, in, segments[item.segment], item.head,
          SequenceState(state, segments[item.segment].slot), off, w1, out_all, rows, commit,
          [&] { copy_w1(next, [&] { return segments[next.segment]; }); });
      item = next;
    }
  }
}

// Prefill, TTT-Linear: the tokens of a window at once, in the dual form (spec §3.7). One block per
// (sequence, head) walks the sequence's windows in order, θ0 in shared memory throughout. Threads
// take two shapes:
// - by column, for the products with θ0: thread (c, h) owns column c and half h of the window's
//   tokens, so each pass over W1 reads every weight once for eight tokens (z = k·W1 + b1,
//   zq = q·W1 + b1, the commit's W1 −= Σ_j τ·lr_j·k_jᵀ g_j);
// - by token, for what reduces over columns: kLanes lanes per token, each with f/kLanes columns,
//   so all of a window's tokens reduce at once (the gradient at θ0, q_r·k_j, the output's
//   LayerNorm).
// Two shapes of block: eight lanes a token (128 threads, each column's tokens in two halves) for
// long prefills, where four blocks share an SM; a warp a token (512 threads, a column's tokens in
// eighths) where the grid leaves SMs idle, as one short prompt's does: there each of the narrow
// form's warps, alone on its scheduler, waits out every dependent load and FMA (a 16-token window
// took ~21 µs, bench/README.md v69).
// A chunk may start inside a window: the open window's pending rows come from the state, and the
// rows of a window left open go back to it. Loads into shared memory are cp.async, so a block has
// all of a window's rows (and θ0) in flight at once.
// K of this kernel (every known model; others: the general one).
constexpr int kPrefillWindow = 16;
constexpr int kPrefillMaxF = 64;
constexpr int kNarrowLanes = 8, kWideLanes = 32;
// Shared rows are f + 8 floats apart: the four tokens a narrow warp covers then fall in distinct
// banks.
constexpr int kPrefillRowPad = 8;

template <int kLanes>
constexpr int kPrefillThreads = kPrefillWindow * kLanes;

// Sum over the kLanes lanes of one token (consecutive lanes, within a warp).
template <int kLanes>
__device__ __forceinline__ float TokenSum(float v) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// The LayerNorm of token t's row of `rows` (shared, P floats apart) spread over its lanes: lane s
// holds columns s + kLanes·m (zero past f, and everywhere when !active), centred, and 1/s is
// returned. Every lane of the warp must call it (the sums are shuffles).
template <int kLanes>
__device__ __forceinline__ float CentreTokenRow(const float* rows, int P, int t, bool active, int f,
                                                int s, float eps,
                                                float (&row)[kPrefillMaxF / kLanes]) {
  constexpr int kColumns = kPrefillMaxF / kLanes;
  float sum = 0;
#pragma unroll
  for (int m = 0; m < kColumns; ++m) {
    const int col = s + m * kLanes;
    row[m] = active && col < f ? rows[t * P + col] : 0.0f;
    sum += row[m];
  }
  const float mean = TokenSum<kLanes>(sum) / f;
  float square = 0;
#pragma unroll
  for (int m = 0; m < kColumns; ++m) {
    row[m] = s + m * kLanes < f ? row[m] - mean : 0.0f;
    square += row[m] * row[m];
  }
  return rsqrtf(TokenSum<kLanes>(square) / f + eps);
}

// Narrow, four blocks an SM: a prefill of 16 sequences × 32 heads (the 1b model) is then one
// wave. At this register cap ptxas spills a few registers, which costs far less than a second
// wave. Wide, at most 64 registers: a block then fits beside the decode kernel's warps (7 an SM
// beside a scan, 128 registers each).
template <int kLanes>
__global__ void __launch_bounds__(kPrefillThreads<kLanes>, kLanes == kNarrowLanes ? 4 : 2)
    TttPrefillLinearKernel(TttScanParams p, const Segment* segments, const float* q_all,
                           const float* k_all, const float* v_all, const float* lr_all,
                           StateAddress state, TttStateOffsets off, float* out_all) {
  constexpr int K = kPrefillWindow, kThreads = kPrefillThreads<kLanes>;
  constexpr int kGroups = kThreads / kPrefillMaxF;  // Of a column's tokens, by column.
  constexpr int kTokens = K / kGroups;              // A thread's tokens, by column.
  constexpr int kColumns = kPrefillMaxF / kLanes;   // A lane's columns, by token.
  static_assert(kThreads % kPrefillMaxF == 0 && K % kGroups == 0);
  extern __shared__ float4 dynamic4[];
  __shared__ float lrs[K];
  __shared__ float coef[K][K + 1];  // τ_r·lr_j·(q_r·k_j + 1), j ≤ r.
  __shared__ float gamma[kPrefillMaxF], beta[kPrefillMaxF];  // The inner LayerNorm's.
  const int f = p.f, nh = p.nh, D = nh * f, P = f + kPrefillRowPad;
  float* w1 = reinterpret_cast<float*>(dynamic4);  // [f, P]
  float* keys = w1 + f * P;                         // [K, P]
  float* grads = keys + K * P;                      // [K, P]
  float* queries = grads + K * P;                   // [K, P]
  float* values = queries + K * P;                  // [K, P]
  float* z = values + K * P;                        // [K, P]: k·W1 + b1, then z̄

  WaitForPreviousKernel();
  const Segment seg = segments[blockIdx.x / nh];
  if (seg.count == 0) return;
  const int head = blockIdx.x % nh;
  float* base = SequenceState(state, seg.slot);
  float* W1 = base + off.W1 + static_cast<size_t>(head) * f * f;
  float* b1 = base + off.b1 + head * f;
  float* pk = base + off.k + head * K * f;
  float* pg = base + off.g1 + head * K * f;
  float* plr = base + off.lr + head * K;

  // By column: thread (c, h), h the group of kTokens tokens.
  const int c = threadIdx.x % kPrefillMaxF, h = threadIdx.x / kPrefillMaxF;
  const bool column_active = c < f;
  // By token: thread (t, s).
  const int t = threadIdx.x / kLanes, s = threadIdx.x % kLanes;

  // rows × f floats from `from` (row stride from_stride) into shared rows P apart, 16 bytes per
  // copy: f is a multiple of 4, and so is every row's offset.
  auto copy_rows_async = [&](float* to, const float* from, int64_t from_stride, int rows) {
    const int quads = f / 4;
    for (int i = threadIdx.x; i < rows * quads; i += kThreads) {
      const int row = i / quads, col = 4 * (i % quads);
      __pipeline_memcpy_async(to + row * P + col, from + row * from_stride + col, 16);
    }
  };
  // W1 whole, or its halves (TttStateOffsets::w1_split) four columns a uint2.
  uint2* W1_upper = reinterpret_cast<uint2*>(base + off.W1) + head * f * f / 4;
  uint2* W1_lower = W1_upper + nh * f * f / 4;
  const int open = WindowPosition(seg, K);  // Pending rows of the window it starts in.
  if (off.w1_split) {
    for (int i = threadIdx.x; i < f * f / 4; i += kThreads) {
      const int row = i / (f / 4), col = 4 * (i % (f / 4));
      *reinterpret_cast<float4*>(&w1[row * P + col]) = JoinHalves(W1_upper[i], W1_lower[i]);
    }
  } else {
    copy_rows_async(w1, W1, f, f);
  }
  copy_rows_async(keys, pk, f, open);
  copy_rows_async(grads, pg, f, open);
  __pipeline_commit();
  if (threadIdx.x < open) lrs[threadIdx.x] = plr[threadIdx.x];
  float bias = column_active ? b1[c] : 0.0f;
  if (threadIdx.x < f) {
    gamma[threadIdx.x] = p.ln_weight[head * f + threadIdx.x];
    beta[threadIdx.x] = p.ln_bias[head * f + threadIdx.x];
  }

  bool committed = false;
  int r0 = open, r1 = open - 1;
  for (int done = 0; done < seg.count; done += r1 - r0 + 1) {
    r0 = static_cast<int>((seg.start + done) % K);
    r1 = r0 + min(K - r0, seg.count - done) - 1;
    const int64_t row0 = seg.row + done - r0;  // The row window index 0 would have.
    const int64_t at0 = (row0 + r0) * D + head * f;
    copy_rows_async(queries + r0 * P, q_all + at0, D, r1 - r0 + 1);
    copy_rows_async(keys + r0 * P, k_all + at0, D, r1 - r0 + 1);
    copy_rows_async(values + r0 * P, v_all + at0, D, r1 - r0 + 1);
    __pipeline_commit();
    if (threadIdx.x >= r0 && threadIdx.x <= r1) {
      lrs[threadIdx.x] = lr_all[(row0 + threadIdx.x) * nh + head];
    }
    __pipeline_wait_prior(0);
    __syncthreads();

    // By column: z = k·W1 + b1 (to shared) and zq = q·W1 + b1 (kept) for this group's tokens.
    float zq[kTokens];
    if (column_active) {
      float z1[kTokens];
#pragma unroll
      for (int i = 0; i < kTokens; ++i) z1[i] = zq[i] = bias;
#pragma unroll 1
      for (int d = 0; d < f; d += 4) {
        const float w[4] = {w1[d * P + c], w1[(d + 1) * P + c], w1[(d + 2) * P + c],
                            w1[(d + 3) * P + c]};
#pragma unroll
        for (int i = 0; i < kTokens; ++i) {
          const int r = h * kTokens + i;
          if (r < r0 || r > r1) continue;
          const float4 kr = *reinterpret_cast<const float4*>(&keys[r * P + d]);
          const float4 qr = *reinterpret_cast<const float4*>(&queries[r * P + d]);
          z1[i] += kr.x * w[0] + kr.y * w[1] + kr.z * w[2] + kr.w * w[3];
          zq[i] += qr.x * w[0] + qr.y * w[1] + qr.z * w[2] + qr.w * w[3];
        }
      }
#pragma unroll
      for (int i = 0; i < kTokens; ++i) {
        const int r = h * kTokens + i;
        if (r >= r0 && r <= r1) z[r * P + c] = z1[i];
      }
    }
    __syncthreads();

    // By token: the gradient of token t's loss at θ0 (spec §3.5), and q_t·k_j for j ≤ t.
    const bool token_active = t >= r0 && t <= r1;
    {
      float row[kColumns];
      const float inv_std = CentreTokenRow<kLanes>(z, P, t, token_active, f, s, p.ln_eps, row);
      float e[kColumns], sum_e = 0, sum_e_xhat = 0;
#pragma unroll
      for (int m = 0; m < kColumns; ++m) {
        const int col = s + m * kLanes;
        const float xhat = row[m] * inv_std;
        const bool live = token_active && col < f;
        const float target = live ? values[t * P + col] - keys[t * P + col] : 0.0f;
        const float scale = live ? gamma[col] : 0.0f;
        e[m] = scale * ((scale * xhat + (live ? beta[col] : 0.0f)) - target);
        sum_e += e[m];
        sum_e_xhat += e[m] * xhat;
      }
      sum_e = TokenSum<kLanes>(sum_e);
      sum_e_xhat = TokenSum<kLanes>(sum_e_xhat);
#pragma unroll
      for (int m = 0; m < kColumns; ++m) {
        const int col = s + m * kLanes;
        const float xhat = row[m] * inv_std;
        if (token_active && col < f) {
          grads[t * P + col] = (f * e[m] - sum_e - xhat * sum_e_xhat) * inv_std / f;
        }
      }
      for (int j = s; j <= t && token_active; j += kLanes) {
        float dot = 0;
        for (int d = 0; d < f; d += 4) {
          const float4 q4 = *reinterpret_cast<const float4*>(&queries[t * P + d]);
          const float4 k4 = *reinterpret_cast<const float4*>(&keys[j * P + d]);
          dot += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
        }
        coef[t][j] = p.tau[t] * lrs[j] * (dot + 1.0f);
      }
    }
    __syncthreads();

    // By column: z̄_r = zq_r − Σ_{j≤r} coef[r][j]·g_j.
    if (column_active) {
      float g[K];
#pragma unroll
      for (int j = 0; j < K; ++j) g[j] = j <= r1 ? grads[j * P + c] : 0.0f;
#pragma unroll
      for (int i = 0; i < kTokens; ++i) {
        const int r = h * kTokens + i;
        if (r < r0 || r > r1) continue;
        float zbar = zq[i];
#pragma unroll
        for (int j = 0; j < K; ++j) {
          if (j <= r) zbar -= coef[r][j] * g[j];
        }
        z[r * P + c] = zbar;
      }
    }
    __syncthreads();

    // By token: out = q + LN(z̄). Every lane takes part in the shuffles.
    {
      float row[kColumns];
      const float inv_std = CentreTokenRow<kLanes>(z, P, t, token_active, f, s, p.ln_eps, row);
      const int64_t at = (row0 + t) * D + head * f;
#pragma unroll
      for (int m = 0; m < kColumns; ++m) {
        const int col = s + m * kLanes;
        if (token_active && col < f) {
          out_all[at + col] = queries[t * P + col] + gamma[col] * row[m] * inv_std + beta[col];
        }
      }
    }

    // By column, after the window's last token: θ0 becomes θ̄, W1 −= Σ_j τ·lr_j·k_jᵀ g_j and
    // b1 −= Σ_j τ·lr_j·g_j; group h takes every kGroups-th set of four rows of W1.
    if (r1 == K - 1) {
      if (column_active) {
        const float tau_last = p.tau[K - 1];
        float g[K];  // τ·lr_j·g_j
#pragma unroll
        for (int j = 0; j < K; ++j) {
          g[j] = tau_last * lrs[j] * grads[j * P + c];
          bias -= g[j];
        }
        for (int d = 4 * h; d < f; d += 4 * kGroups) {
          float update[4] = {0, 0, 0, 0};
#pragma unroll
          for (int j = 0; j < K; ++j) {
            const float4 k4 = *reinterpret_cast<const float4*>(&keys[j * P + d]);
            update[0] += k4.x * g[j];
            update[1] += k4.y * g[j];
            update[2] += k4.z * g[j];
            update[3] += k4.w * g[j];
          }
#pragma unroll
          for (int i = 0; i < 4; ++i) w1[(d + i) * P + c] -= update[i];
        }
      }
      committed = true;
    }
    __syncthreads();  // The window's rows are read before the next window's overwrite them.
  }

  if (committed) {
    for (int i = threadIdx.x; i < f * f / 4; i += kThreads) {
      const int row = i / (f / 4), col = 4 * (i % (f / 4));
      const float4 w = *reinterpret_cast<const float4*>(&w1[row * P + col]);
      if (off.w1_split) {
        SplitHalves(w, &W1_upper[i], &W1_lower[i]);
      } else {
        *reinterpret_cast<float4*>(&W1[row * f + col]) = w;
      }
    }
    if (column_active && h == 0) b1[c] = bias;
  }
  // A window left open keeps its new rows pending in the state.
  if (r1 < K - 1) {
    for (int i = threadIdx.x; i < (r1 - r0 + 1) * f; i += kThreads) {
      const int row = r0 + i / f, col = i % f;
      pk[row * f + col] = keys[row * P + col];
      pg[row * f + col] = grads[row * P + col];
    }
    if (threadIdx.x >= r0 && threadIdx.x <= r1) plr[threadIdx.x] = lrs[threadIdx.x];
  }
}

size_t PrefillSharedBytes(const TttScanParams& params) {
  const size_t row = params.f + kPrefillRowPad;
  return sizeof(float) * row * (params.f + 5 * kPrefillWindow);
}

// Without opting in, a block gets at most this much dynamic shared memory.
constexpr size_t kDefaultSharedBytes = 48 * 1024;

// Whether the state parts that the window kernels copy in 16-byte pieces start on 16-byte
// boundaries (rows of f floats, f % 4 == 0).
bool SixteenByteAligned(const TttScanParams& params, StateAddress state, TttStateOffsets offsets) {
  return params.f % 4 == 0 && state.slot_floats % 4 == 0 && state.layer_offset % 4 == 0 &&
         offsets.W1 % 4 == 0 && offsets.b1 % 4 == 0 && offsets.k % 4 == 0 && offsets.g1 % 4 == 0;
}

// The decode warps an SM takes beside a scan of the same step (TttDecode's beside_scan): each
// SM then keeps room for scan blocks, which otherwise start only as decode warps retire. Of the
// 13 that fit at f = 64, 7 was the best of 3-11 in steps mixing prompts (bench/README.md v30).
// They keep to 128 registers: at 168, a quarter of the register file holding two of them has
// room for one scan warp, not two (v39).
constexpr int kDecodeWarpsPerSmBesideScan = 7;

// The device's SMs, found on first use.
cudaError_t DeviceSms(int* sms) {
  static std::atomic<int> count{0};
  if (count.load() == 0) {
    int device = 0, found = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess) {
      status = cudaDeviceGetAttribute(&found, cudaDevAttrMultiProcessorCount, device);
    }
    if (status != cudaSuccess) return status;
    count = std::max(1, found);
  }
  *sms = count.load();
  return cudaSuccess;
}

// As many warps of a register budget as fit on the device at once (the decode kernel is
// persistent: each walks items a grid apart), found on first use.
template <int kF, int kTaps, bool kSplit, int kWarpsPerSm>
cudaError_t ResidentDecodeWarps(int* sms, int* per_sm) {
  static std::atomic<int> fit_per_sm{0};
  if (cudaError_t status = DeviceSms(sms); status != cudaSuccess) return status;
  if (fit_per_sm.load() == 0) {
    int fit = 0;
    if (cudaError_t status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &fit, TttDecodeLinearKernel<kF, kTaps, kSplit, kWarpsPerSm>, kWarp,
            DecodeSharedBytes(kF));
        status != cudaSuccess) {
      return status;
    }
    fit_per_sm = std::max(1, fit);
  }
  *per_sm = fit_per_sm.load();
  return cudaSuccess;
}

// Whether `warps` warps dealt `items` items in turn have room for a staggered step's commits:
// sequences at staggered offsets, as a server's are, commit one item in K a step, and
// PlanDecodeOrder puts those on warps with an item fewer than the busiest (bench/README.md v28).
// Placed on the busiest, they end the step late.
bool CommitsFitLighterWarps(int items, int K, int warps) {
  if (warps >= items) return true;  // An item a warp.
  const int busiest = (items + warps - 1) / warps;
  return busiest * warps - items >= items / K;
}

// How TttDecode runs a step: the kernel's register budget, and its grid.
struct DecodeGrid {
  bool roomy;  // kRoomyDecodeWarpsPerSm's budget, else kMostDecodeWarpsPerSm's.
  int warps;
};

// Decode alone, the roomier budget where its warps have room for a staggered step's commits
// (1b at 256 rows; not 125m, whose 3,072 items leave 96 of 1,584 warps an item lighter for ~192
// commits: bench/README.md v39); beside a scan, the tighter, on kDecodeWarpsPerSmBesideScan an SM.
template <int kF, int kTaps, bool kSplit>
cudaError_t PlanDecodeGrid(int items, int K, bool beside_scan, DecodeGrid* grid) {
  int sms = 0, most = 0, roomy = 0;
  cudaError_t status =
      ResidentDecodeWarps<kF, kTaps, kSplit, kMostDecodeWarpsPerSm>(&sms, &most);
  if (status == cudaSuccess) {
    status = ResidentDecodeWarps<kF, kTaps, kSplit, kRoomyDecodeWarpsPerSm>(&sms, &roomy);
  }
  if (status != cudaSuccess) return status;
  if (beside_scan) {
    *grid = {false, std::min(items, sms * std::min(most, kDecodeWarpsPerSmBesideScan))};
  } else if (CommitsFitLighterWarps(items, K, sms * roomy)) {
    *grid = {true, std::min(items, sms * roomy)};
  } else {
    *grid = {false, std::min(items, sms * most)};
  }
  return cudaSuccess;
}

template <int kF, int kTaps, bool kSplit>
cudaError_t LaunchDecodeLinear(const TttScanParams& params, const TttProjectionInputs& inputs,
                               const Segment* segments, int num_segments, StateAddress state,
                               TttStateOffsets offsets, float* out, bool beside_scan,
                               cudaStream_t stream) {
  const int items = num_segments * params.nh;
  DecodeGrid grid;
  if (cudaError_t status = PlanDecodeGrid<kF, kTaps, kSplit>(items, params.K, beside_scan, &grid);
      status != cudaSuccess) {
    return status;
  }
  const auto kernel = grid.roomy
                          ? TttDecodeLinearKernel<kF, kTaps, kSplit, kRoomyDecodeWarpsPerSm>
                          : TttDecodeLinearKernel<kF, kTaps, kSplit, kMostDecodeWarpsPerSm>;
  return Launch(kernel, grid.warps, kWarp, DecodeSharedBytes(kF), stream, params, inputs,
                segments, items, state, offsets, out);
}

// Calls run(taps, split) with the decode kernel's form for the conv and for how W1 is held, as
// integral constants (their ::value are kTaps and kSplit).
template <typename Run>
cudaError_t WithDecodeForm(const TttProjectionInputs& inputs, TttStateOffsets offsets, Run run) {
  using FourTaps = std::integral_constant<int, kFourTaps>;
  using AnyTaps = std::integral_constant<int, kMaxTaps>;
  const bool four_taps = FourChannelLoadsFit(inputs);
  if (offsets.w1_split) {
    return four_taps ? run(FourTaps{}, std::true_type{}) : run(AnyTaps{}, std::true_type{});
  }
  return four_taps ? run(FourTaps{}, std::false_type{}) : run(AnyTaps{}, std::false_type{});
}

template <int kF>
cudaError_t LaunchDecodeLinear(const TttScanParams& params, const TttProjectionInputs& inputs,
                               const Segment* segments, int num_segments, StateAddress state,
                               TttStateOffsets offsets, float* out, bool beside_scan,
                               cudaStream_t stream) {
  return WithDecodeForm(inputs, offsets, [&](auto taps, auto split) {
    return LaunchDecodeLinear<kF, decltype(taps)::value, decltype(split)::value>(
        params, inputs, segments, num_segments, state, offsets, out, beside_scan, stream);
  });
}

template <int kF>
cudaError_t PlanDecodeGrid(const TttScanParams& params, const TttProjectionInputs& inputs,
                           TttStateOffsets offsets, int items, bool beside_scan, DecodeGrid* grid) {
  return WithDecodeForm(inputs, offsets, [&](auto taps, auto split) {
    return PlanDecodeGrid<kF, decltype(taps)::value, decltype(split)::value>(items, params.K,
                                                                             beside_scan, grid);
  });
}

}  // namespace

bool TttDecodeFits(const TttScanParams& params, const TttProjectionInputs& inputs,
                   StateAddress state, TttStateOffsets offsets) {
  return !params.mlp && (params.f == 16 || params.f == 32 || params.f == 64) &&
         params.K <= kDecodeMaxWindow && SixteenByteAligned(params, state, offsets) &&
         (!inputs.share_qk || inputs.conv.ck - 1 <= kMaxHistory);
}

cudaError_t TttDecode(const TttScanParams& params, const TttProjectionInputs& inputs,
                      const Segment* segments, int num_segments, StateAddress state,
                      TttStateOffsets offsets, float* out, bool beside_scan, cudaStream_t stream) {
  if (!TttDecodeFits(params, inputs, state, offsets)) return cudaErrorNotSupported;
  if (num_segments == 0) return cudaSuccess;
  switch (params.f) {
    case 16:
      return LaunchDecodeLinear<16>(params, inputs, segments, num_segments, state, offsets, out,
                                    beside_scan, stream);
    case 32:
      return LaunchDecodeLinear<32>(params, inputs, segments, num_segments, state, offsets, out,
                                    beside_scan, stream);
    default:
      return LaunchDecodeLinear<64>(params, inputs, segments, num_segments, state, offsets, out,
                                    beside_scan, stream);
  }
}

int TttDecodeWarps(const TttScanParams& params, const TttProjectionInputs& inputs,
                   TttStateOffsets offsets, int num_segments, bool beside_scan) {
  const int items = num_segments * params.nh;
  DecodeGrid grid;
  const cudaError_t status =
      params.f == 16   ? PlanDecodeGrid<16>(params, inputs, offsets, items, beside_scan, &grid)
      : params.f == 32 ? PlanDecodeGrid<32>(params, inputs, offsets, items, beside_scan, &grid)
                       : PlanDecodeGrid<64>(params, inputs, offsets, items, beside_scan, &grid);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return grid.warps;
}

cudaError_t TttScan(const TttScanParams& params, const Segment* segments, int num_segments,
                    const float* q, const float* k, const float* v, const float* lr,
                    StateAddress state, TttStateOffsets offsets, float* out, cudaStream_t stream) {
  if (num_segments == 0) return cudaSuccess;
  if (params.K > kMaxK || params.f1 > kMaxScanThreads) return cudaErrorInvalidValue;
  if (!params.mlp && params.K == kPrefillWindow && params.f <= kPrefillMaxF &&
      SixteenByteAligned(params, state, offsets) &&
      PrefillSharedBytes(params) <= kDefaultSharedBytes) {
    const int blocks = num_segments * params.nh;
    int sms = 0;
    if (cudaError_t status = DeviceSms(&sms); status != cudaSuccess) return status;
    // A grid that leaves SMs idle (one short prompt's) takes the wide form.
    const bool wide = blocks <= sms;
    return Launch(wide ? TttPrefillLinearKernel<kWideLanes> : TttPrefillLinearKernel<kNarrowLanes>,
                  blocks, wide ? kPrefillThreads<kWideLanes> : kPrefillThreads<kNarrowLanes>,
                  PrefillSharedBytes(params), stream, params, segments, q, k, v, lr, state, offsets,
                  out);
  }
  const int threads = RoundUpToWarp(params.f1);
  const size_t shared_bytes =
      sizeof(float) * (3 * params.f + 2 * params.f1 + params.K * (params.f + params.f1) + threads);
  return Launch(TttScanKernel, num_segments * params.nh, threads, shared_bytes, stream, params,
                segments, q, k, v, lr, state, offsets, out);
}

}  // namespace ttt::kernels::cuda
