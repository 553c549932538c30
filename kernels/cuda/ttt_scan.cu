// The TTT inner loop on the GPU: one block per (sequence, head), tokens in order.
//
// Each token: its gradient at θ0 joins the window's pending tokens (kept in the state, so a
// sequence can stop and resume anywhere), its output is the dual-form row over the window's tokens
// up to itself, and after a window's last token θ0 is rewritten.
//
// Two kernels. The general one (any number of tokens, TTT-Linear and TTT-MLP): thread c owns
// column c of W1 (and row c of W2), so the pass over θ0 for a token reads every weight once,
// coalesced; θ0 stays in device memory (L1/L2-cached) across tokens. The decode one (TTT-Linear,
// one token per sequence, the hot path of serving) copies θ0 to shared memory asynchronously, so
// that all of it is in flight at once, and pairs independent reductions on one barrier.
#include <cuda_pipeline.h>

#include "kernels/cuda/common.cuh"

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

__global__ void TttScanKernel(TttScanParams p, const Segment* segments, const float* q_all,
                              const float* k_all, const float* v_all, const float* lr_all,
                              StateAddress state, TttStateOffsets off, float* out_all) {
  extern __shared__ float dynamic[];
  __shared__ SharedScratch shared;
  const int f = p.f, f1 = p.f1, K = p.K, nh = p.nh, D = nh * f;
  float* q = dynamic;      // [f]
  float* k = q + f;        // [f]
  float* x2bar = k + f;    // [f1] (mlp)
  float* x2 = x2bar + f1;  // [f1] (mlp)
  float* g2 = x2 + f1;     // [f] (mlp)
  float* staged = g2 + f;  // [K, f + f1]: a window's pending rows, staged for the commit.

  const Segment seg = segments[blockIdx.x / nh];
  const int head = blockIdx.x % nh;
  float* base = SequenceState(state, seg.slot);
  float* W1 = base + off.W1 + static_cast<size_t>(head) * f * f1;
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
#pragma unroll 8
      for (int d = 0; d < f; ++d) {
        const float w = W1[d * f1 + c];
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
      float z2 = 0;
      if (in_f) {
        z2 = b2[c];
#pragma unroll 8
        for (int d = 0; d < f1; ++d) z2 += x2[d] * W2[d * f + c];
      }
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
      if (in_f1) {
        float back = 0;
        for (int e = 0; e < f; ++e) back += g2[e] * W2[c * f + e];
        pg1[r * f1 + c] = back * GeluDerivative(z1);
      }
      __syncthreads();
      // Query side, first layer.
      DualCoefficients(q, pk, f, r, p.tau[r], plr, shared.coef);
      __syncthreads();
      if (in_f1) {
        float zbar1 = zq;
        for (int j = 0; j <= r; ++j) zbar1 -= shared.coef[j] * pg1[j * f1 + c];
        x2bar[c] = Gelu(zbar1);
      }
      __syncthreads();
      // Second layer.
      DualCoefficients(x2bar, px2, f1, r, p.tau[r], plr, shared.coef);
      __syncthreads();
      zbar = 0;
      if (in_f) {
        zbar = b2[c];
#pragma unroll 8
        for (int d = 0; d < f1; ++d) zbar += x2bar[d] * W2[d * f + c];
        for (int j = 0; j <= r; ++j) zbar -= shared.coef[j] * pg2[j * f + c];
      }
    }
    const float normalized = LayerNormOf(zbar, in_f, f, gamma, beta, p.ln_eps, shared.reduce);
    if (in_f) out_all[at + c] = q[c] + normalized;

    // After the window's last token, θ0 takes the last token's θ̄: W −= Σ_j τ·lr_j · aⱼᵀ gⱼ for
    // each layer, with the window's rows staged in shared memory (left [K, width_a], scaled by
    // τ·lr_j, and right [K, width_g]).
    if (r == K - 1) {
      const float tau = p.tau[K - 1];
      auto commit = [&](const float* left, int left_width, const float* right, int right_width,
                        float* W, float* b) {
        float* a = staged;                   // [K, left_width]
        float* g = staged + K * left_width;  // [K, right_width]
        __syncthreads();
        for (int i = c; i < K * left_width; i += blockDim.x)
          a[i] = tau * plr[i / left_width] * left[i];
        for (int i = c; i < K * right_width; i += blockDim.x) g[i] = right[i];
        __syncthreads();
        if (c < right_width) {
          for (int d = 0; d < left_width; ++d) {
            float update = 0;
            for (int j = 0; j < K; ++j) update += a[j * left_width + d] * g[j * right_width + c];
            W[d * right_width + c] -= update;
          }
          float update = 0;
          for (int j = 0; j < K; ++j) update += tau * plr[j] * g[j * right_width + c];
          b[c] -= update;
        }
      };
      commit(pk, f, pg1, f1, W1, b1);              // W1 [f, f1]: keys and first-layer gradients.
      if (p.mlp) commit(px2, f1, pg2, f, W2, b2);  // W2 [f1, f]: hidden activations, g2.
    }
    __syncthreads();  // θ0, pending rows and shared inputs settle before the next token.
  }
}

constexpr int kDecodeMaxF = 64;  // f ≤ this uses the decode kernel (64 in all presets but 760m).

// Sums over the block; every thread gets the results. Two values at once, so that reductions
// that do not depend on each other share the barriers.
__device__ __forceinline__ float2 BlockSum2(float2 v, float2* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v.x = WarpSum(v.x);
  v.y = WarpSum(v.y);
  __syncthreads();  // Earlier readers of scratch are done.
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float2 total = {0, 0};
  for (int w = 0; w < blockDim.x / kWarp; ++w) {
    total.x += scratch[w].x;
    total.y += scratch[w].y;
  }
  return total;
}

// Decode, TTT-Linear: one token per sequence. One block of RoundUpToWarp(f) threads per
// (sequence, head); thread c owns column c of W1. θ0 and the window's pending keys and gradients
// are copied to shared memory asynchronously (cp.async: no registers held while in flight), so
// that a block has all of its 16-20 KB in flight at once and the blocks sharing an SM keep HBM
// busy. Shared memory: q, k [f]; keys, gradients [K, f] (this token's row included); W1 [f, f].
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    TttDecodeLinearKernel(TttScanParams p, const Segment* segments, const float* q_all,
                          const float* k_all, const float* v_all, const float* lr_all,
                          StateAddress state, TttStateOffsets off, float* out_all) {
  extern __shared__ float dynamic[];
  __shared__ float2 scratch[kThreads / kWarp];
  __shared__ float dots[kMaxK];  // q·k_j
  __shared__ float lrs[kMaxK];
  const int f = p.f, K = p.K, nh = p.nh, D = nh * f;
  float* sq = dynamic;          // [f]
  float* sk = sq + f;           // [f]
  float* keys = sk + f;         // [K, f]
  float* grads = keys + K * f;  // [K, f]
  float* w1 = grads + K * f;    // [f, f]

  const Segment seg = segments[blockIdx.x / nh];
  if (seg.count == 0) return;  // Padding of a decode graph's batch bucket.
  const int head = blockIdx.x % nh;
  const int r = static_cast<int>(seg.start % K);
  const int64_t at = static_cast<int64_t>(seg.row) * D + head * f;
  float* base = SequenceState(state, seg.slot);
  float* W1 = base + off.W1 + static_cast<size_t>(head) * f * f;
  float* b1 = base + off.b1 + head * f;
  float* pk = base + off.k + head * K * f;
  float* pg = base + off.g1 + head * K * f;
  float* plr = base + off.lr + head * K;

  const int c = threadIdx.x, lane = c % kWarp, warp = c / kWarp;
  const bool active = c < f;

  if (active) {
    for (int d = 0; d < f; ++d) __pipeline_memcpy_async(&w1[d * f + c], &W1[d * f + c], 4);
    for (int j = 0; j < r; ++j) {
      __pipeline_memcpy_async(&keys[j * f + c], &pk[j * f + c], 4);
      __pipeline_memcpy_async(&grads[j * f + c], &pg[j * f + c], 4);
    }
  }
  __pipeline_commit();
  const float bias = active ? b1[c] : 0.0f;
  const float v_c = active ? v_all[at + c] : 0.0f;
  const float gamma = active ? p.ln_weight[head * f + c] : 0.0f;
  const float beta = active ? p.ln_bias[head * f + c] : 0.0f;
  const float lr_t = lr_all[static_cast<int64_t>(seg.row) * nh + head];
  const float tau_r = p.tau[r], tau_last = p.tau[K - 1];
  if (active) {
    sq[c] = q_all[at + c];
    sk[c] = k_all[at + c];
  }
  if (c < r) lrs[c] = plr[c];
  __pipeline_wait_prior(0);
  __syncthreads();

  // z1 = k·W1 + b1 and zq = q·W1 + b1, then the gradient of this token's loss at θ0 (spec §3.5).
  float z1 = bias, zq = bias;
  if (active) {
#pragma unroll 8
    for (int d = 0; d < f; ++d) {
      const float w = w1[d * f + c];
      z1 += sk[d] * w;
      zq += sq[d] * w;
    }
  }
  const float k_c = active ? sk[c] : 0.0f;
  const float mean = BlockSum2({active ? z1 : 0.0f, 0.0f}, scratch).x / f;
  const float centered = active ? z1 - mean : 0.0f;
  const float inv_std = rsqrtf(BlockSum2({centered * centered, 0.0f}, scratch).x / f + p.ln_eps);
  const float xhat = centered * inv_std;
  const float e = active ? gamma * ((gamma * xhat + beta) - (v_c - k_c)) : 0.0f;
  const float2 sums = BlockSum2({e, e * xhat}, scratch);
  const float g = (f * e - sums.x - xhat * sums.y) * inv_std / f;
  if (active) {
    keys[r * f + c] = k_c;
    grads[r * f + c] = g;
    pk[r * f + c] = k_c;
    pg[r * f + c] = g;
  }
  if (c == 0) {
    lrs[r] = lr_t;
    plr[r] = lr_t;
  }
  __syncthreads();

  // q·k_j for the window's tokens, a warp per token.
  for (int j = warp; j <= r; j += blockDim.x / kWarp) {
    float dot = 0;
    for (int d = lane; d < f; d += kWarp) dot += sq[d] * keys[j * f + d];
    dot = WarpSum(dot);
    if (lane == 0) dots[j] = dot;
  }
  __syncthreads();

  // The dual-form row: z̄ = zq − Σ_{j≤r} τ_r·lr_j·(q·k_j + 1)·g_j, out = q + LN(z̄).
  float zbar = zq;
  if (active) {
    for (int j = 0; j <= r; ++j) zbar -= tau_r * lrs[j] * (dots[j] + 1.0f) * grads[j * f + c];
  }
  const float out_mean = BlockSum2({active ? zbar : 0.0f, 0.0f}, scratch).x / f;
  const float out_centered = active ? zbar - out_mean : 0.0f;
  const float out_inv_std =
      rsqrtf(BlockSum2({out_centered * out_centered, 0.0f}, scratch).x / f + p.ln_eps);
  if (active) out_all[at + c] = sq[c] + (gamma * out_centered * out_inv_std + beta);

  // After the window's last token θ0 becomes θ̄ (spec §4): W1 −= Σ_j τ·lr_j·k_jᵀ g_j and
  // b1 −= Σ_j τ·lr_j·g_j.
  if (r == K - 1 && active) {
    for (int d = 0; d < f; ++d) {
      float update = 0;
      for (int j = 0; j < K; ++j) update += tau_last * lrs[j] * keys[j * f + d] * grads[j * f + c];
      W1[d * f + c] = w1[d * f + c] - update;
    }
    float update = 0;
    for (int j = 0; j < K; ++j) update += tau_last * lrs[j] * grads[j * f + c];
    b1[c] = bias - update;
  }
}

// A warp's LayerNorm of one row of f ≤ 64 values, lane owning columns lane and lane + 32: the
// centred values (zero past f) in `centred`, and 1/s returned.
__device__ __forceinline__ float CentreRow(const float* row, int f, float eps,
                                           float (&centred)[2]) {
  const int lane = threadIdx.x % kWarp;
  float sum = 0;
  for (int m = 0; m < 2; ++m) {
    const int col = lane + m * kWarp;
    centred[m] = col < f ? row[col] : 0.0f;
    sum += centred[m];
  }
  const float mean = WarpSum(sum) / f;
  float square = 0;
  for (int m = 0; m < 2; ++m) {
    centred[m] = lane + m * kWarp < f ? centred[m] - mean : 0.0f;
    square += centred[m] * centred[m];
  }
  return rsqrtf(WarpSum(square) / f + eps);
}

// Prefill, TTT-Linear: the tokens of a window at once, in the dual form (spec §3.7). One block of
// RoundUpToWarp(f) threads per (sequence, head) walks the sequence's windows in order, θ0 in
// shared memory throughout. Per window: z = k·W1 + b1 and zq = q·W1 + b1 for all its tokens with
// thread c owning column c (θ0 read once per window, not once per token); then a warp per token
// for what reduces over columns (the gradient, q·k_j, the output LayerNorm); the commit updates
// θ0 in place. A chunk may start inside a window: the open window's pending rows come from the
// state, and the rows of a window left open go back to it. Every load into shared memory is a
// cp.async, so that a block has all of a window's rows (and θ0) in flight at once.
constexpr int kPrefillWindow = 16;  // K of this kernel (every known model; others: the general one).

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    TttPrefillLinearKernel(TttScanParams p, const Segment* segments, const float* q_all,
                           const float* k_all, const float* v_all, const float* lr_all,
                           StateAddress state, TttStateOffsets off, float* out_all) {
  constexpr int K = kPrefillWindow, kWarps = kThreads / kWarp, kColumnsPerLane = 2;
  extern __shared__ float4 dynamic4[];
  __shared__ float lrs[K];
  __shared__ float coef[K][K + 1];  // τ_r·lr_j·(q_r·k_j + 1), j ≤ r.
  const int f = p.f, nh = p.nh, D = nh * f;
  float* w1 = reinterpret_cast<float*>(dynamic4);  // [f, f]
  float* keys = w1 + f * f;                         // [K, f]
  float* grads = keys + K * f;                      // [K, f]
  float* queries = grads + K * f;                   // [K, f]
  float* values = queries + K * f;                  // [K, f]
  float* z = values + K * f;                        // [K, f]: k·W1 + b1, then z̄

  const Segment seg = segments[blockIdx.x / nh];
  if (seg.count == 0) return;
  const int head = blockIdx.x % nh;
  float* base = SequenceState(state, seg.slot);
  float* W1 = base + off.W1 + static_cast<size_t>(head) * f * f;
  float* b1 = base + off.b1 + head * f;
  float* pk = base + off.k + head * K * f;
  float* pg = base + off.g1 + head * K * f;
  float* plr = base + off.lr + head * K;

  const int c = threadIdx.x, lane = c % kWarp, warp = c / kWarp;
  const bool active = c < f;
  const int open = static_cast<int>(seg.start % K);  // Pending rows of the window it starts in.
  // 16-byte copies: f is a multiple of 4, and so is every row's offset.
  auto copy_async = [](float* to, const float* from, int floats) {
    for (int i = 4 * threadIdx.x; i < floats; i += 4 * kThreads) {
      __pipeline_memcpy_async(to + i, from + i, 16);
    }
  };
  copy_async(w1, W1, f * f);
  copy_async(keys, pk, open * f);
  copy_async(grads, pg, open * f);
  __pipeline_commit();
  if (c < open) lrs[c] = plr[c];
  float bias = active ? b1[c] : 0.0f;
  // The columns a lane covers when a warp works on one token.
  float gamma[kColumnsPerLane], beta[kColumnsPerLane];
  for (int m = 0; m < kColumnsPerLane; ++m) {
    const int col = lane + m * kWarp;
    gamma[m] = col < f ? p.ln_weight[head * f + col] : 0.0f;
    beta[m] = col < f ? p.ln_bias[head * f + col] : 0.0f;
  }

  bool committed = false;
  int r0 = open, r1 = open - 1;
  for (int done = 0; done < seg.count; done += r1 - r0 + 1) {
    r0 = static_cast<int>((seg.start + done) % K);
    r1 = r0 + min(K - r0, seg.count - done) - 1;
    const int64_t row0 = seg.row + done - r0;  // The row window index 0 would have.
    for (int e = 4 * c; e < (r1 - r0 + 1) * f; e += 4 * kThreads) {
      const int r = r0 + e / f, col = e % f;
      const int64_t at = (row0 + r) * D + head * f + col;
      __pipeline_memcpy_async(&queries[r * f + col], &q_all[at], 16);
      __pipeline_memcpy_async(&keys[r * f + col], &k_all[at], 16);
      __pipeline_memcpy_async(&values[r * f + col], &v_all[at], 16);
    }
    __pipeline_commit();
    if (c >= r0 && c <= r1) lrs[c] = lr_all[(row0 + c) * nh + head];
    __pipeline_wait_prior(0);
    __syncthreads();

    float zq[K];
    if (active) {
      float z1[K];
#pragma unroll
      for (int r = 0; r < K; ++r) z1[r] = zq[r] = bias;
      for (int d = 0; d < f; d += 4) {
        const float w[4] = {w1[d * f + c], w1[(d + 1) * f + c], w1[(d + 2) * f + c],
                            w1[(d + 3) * f + c]};
#pragma unroll
        for (int r = 0; r < K; ++r) {
          if (r < r0 || r > r1) continue;
          const float4 kr = *reinterpret_cast<const float4*>(&keys[r * f + d]);
          const float4 qr = *reinterpret_cast<const float4*>(&queries[r * f + d]);
          z1[r] += kr.x * w[0] + kr.y * w[1] + kr.z * w[2] + kr.w * w[3];
          zq[r] += qr.x * w[0] + qr.y * w[1] + qr.z * w[2] + qr.w * w[3];
        }
      }
#pragma unroll
      for (int r = 0; r < K; ++r) {
        if (r >= r0 && r <= r1) z[r * f + c] = z1[r];
      }
    }
    __syncthreads();

    // A warp per token: its gradient at θ0 (spec §3.5), and q_r·k_j for j ≤ r.
    for (int r = r0 + warp; r <= r1; r += kWarps) {
      float zc[kColumnsPerLane];
      const float inv_std = CentreRow(&z[r * f], f, p.ln_eps, zc);
      float e[kColumnsPerLane], sum_e = 0, sum_e_xhat = 0;
      for (int m = 0; m < kColumnsPerLane; ++m) {
        const int col = lane + m * kWarp;
        const float xhat = zc[m] * inv_std;
        const float target = col < f ? values[r * f + col] - keys[r * f + col] : 0.0f;
        e[m] = col < f ? gamma[m] * ((gamma[m] * xhat + beta[m]) - target) : 0.0f;
        sum_e += e[m];
        sum_e_xhat += e[m] * xhat;
      }
      sum_e = WarpSum(sum_e);
      sum_e_xhat = WarpSum(sum_e_xhat);
      for (int m = 0; m < kColumnsPerLane; ++m) {
        const int col = lane + m * kWarp;
        const float xhat = zc[m] * inv_std;
        if (col < f) grads[r * f + col] = (f * e[m] - sum_e - xhat * sum_e_xhat) * inv_std / f;
      }
      for (int j = 0; j <= r; ++j) {
        float dot = 0;
        for (int col = lane; col < f; col += kWarp) dot += queries[r * f + col] * keys[j * f + col];
        dot = WarpSum(dot);
        if (lane == 0) coef[r][j] = p.tau[r] * lrs[j] * (dot + 1.0f);
      }
    }
    __syncthreads();

    // z̄_r = zq_r − Σ_{j≤r} coef[r][j]·g_j, thread c owning column c.
    float g[K];
    if (active) {
#pragma unroll
      for (int j = 0; j < K; ++j) g[j] = j <= r1 ? grads[j * f + c] : 0.0f;
#pragma unroll
      for (int r = 0; r < K; ++r) {
        if (r < r0 || r > r1) continue;
        float zbar = zq[r];
#pragma unroll
        for (int j = 0; j <= r; ++j) zbar -= coef[r][j] * g[j];
        z[r * f + c] = zbar;
      }
    }
    __syncthreads();

    // A warp per token: out = q + LN(z̄).
    for (int r = r0 + warp; r <= r1; r += kWarps) {
      const int64_t at = (row0 + r) * D + head * f;
      float zc[kColumnsPerLane];
      const float inv_std = CentreRow(&z[r * f], f, p.ln_eps, zc);
      for (int m = 0; m < kColumnsPerLane; ++m) {
        const int col = lane + m * kWarp;
        if (col < f) {
          out_all[at + col] = queries[r * f + col] + gamma[m] * zc[m] * inv_std + beta[m];
        }
      }
    }

    // The window's last token: θ0 becomes θ̄, W1 −= Σ_j τ·lr_j·k_jᵀ g_j, b1 −= Σ_j τ·lr_j·g_j.
    if (r1 == K - 1) {
      if (active) {
        const float tau_last = p.tau[K - 1];
        float update_b = 0;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          g[j] *= tau_last * lrs[j];
          update_b += g[j];
        }
        for (int d = 0; d < f; ++d) {
          float update = 0;
#pragma unroll
          for (int j = 0; j < K; ++j) update += keys[j * f + d] * g[j];
          w1[d * f + c] -= update;
        }
        bias -= update_b;
      }
      committed = true;
    }
    __syncthreads();  // The window's rows are read before the next window's overwrite them.
  }

  if (active && committed) {
    for (int d = 0; d < f; ++d) W1[d * f + c] = w1[d * f + c];
    b1[c] = bias;
  }
  // A window left open keeps its new rows pending in the state.
  if (r1 < K - 1) {
    if (active) {
      for (int j = r0; j <= r1; ++j) {
        pk[j * f + c] = keys[j * f + c];
        pg[j * f + c] = grads[j * f + c];
      }
    }
    if (c >= r0 && c <= r1) plr[c] = lrs[c];
  }
}

size_t PrefillSharedBytes(const TttScanParams& params) {
  return sizeof(float) * (params.f * params.f + 5 * kPrefillWindow * params.f);
}

size_t DecodeSharedBytes(const TttScanParams& params) {
  return sizeof(float) * (2 * params.f + 2 * params.K * params.f + params.f * params.f);
}

// Without opting in, a block gets at most this much dynamic shared memory.
constexpr size_t kDefaultSharedBytes = 48 * 1024;

template <int kThreads>
cudaError_t LaunchDecodeLinear(const TttScanParams& params, const Segment* segments,
                               int num_segments, const float* q, const float* k, const float* v,
                               const float* lr, StateAddress state, TttStateOffsets offsets,
                               float* out, cudaStream_t stream) {
  const size_t shared_bytes = DecodeSharedBytes(params);
  TttDecodeLinearKernel<kThreads><<<num_segments * params.nh, kThreads, shared_bytes, stream>>>(
      params, segments, q, k, v, lr, state, offsets, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t TttScan(const TttScanParams& params, bool one_token_each, const Segment* segments,
                    int num_segments, const float* q, const float* k, const float* v,
                    const float* lr, StateAddress state, TttStateOffsets offsets, float* out,
                    cudaStream_t stream) {
  if (num_segments == 0) return cudaSuccess;
  if (params.K > kMaxK || params.f1 > 1024) return cudaErrorInvalidValue;
  if (one_token_each && !params.mlp && params.f <= kDecodeMaxF &&
      DecodeSharedBytes(params) <= kDefaultSharedBytes) {
    if (params.f <= 32) {
      return LaunchDecodeLinear<32>(params, segments, num_segments, q, k, v, lr, state, offsets,
                                    out, stream);
    }
    return LaunchDecodeLinear<64>(params, segments, num_segments, q, k, v, lr, state, offsets, out,
                                  stream);
  }
  // The prefill kernel's 16-byte copies need rows and state parts on 16-byte boundaries.
  const bool aligned = params.f % 4 == 0 && state.slot_floats % 4 == 0 &&
                       state.layer_offset % 4 == 0 && offsets.W1 % 4 == 0 && offsets.k % 4 == 0 &&
                       offsets.g1 % 4 == 0;
  if (!params.mlp && params.K == kPrefillWindow && params.f <= 2 * kWarp && aligned &&
      PrefillSharedBytes(params) <= kDefaultSharedBytes) {
    const size_t shared_bytes = PrefillSharedBytes(params);
    if (params.f <= kWarp) {
      TttPrefillLinearKernel<kWarp><<<num_segments * params.nh, kWarp, shared_bytes, stream>>>(
          params, segments, q, k, v, lr, state, offsets, out);
    } else {
      TttPrefillLinearKernel<2 * kWarp>
          <<<num_segments * params.nh, 2 * kWarp, shared_bytes, stream>>>(
              params, segments, q, k, v, lr, state, offsets, out);
    }
    return cudaGetLastError();
  }
  const int threads = RoundUpToWarp(params.f1);
  const size_t shared_bytes =
      sizeof(float) * (3 * params.f + 2 * params.f1 + params.K * (params.f + params.f1));
  TttScanKernel<<<num_segments * params.nh, threads, shared_bytes, stream>>>(
      params, segments, q, k, v, lr, state, offsets, out);
  return cudaGetLastError();
}

}  // namespace ttt::kernels::cuda
