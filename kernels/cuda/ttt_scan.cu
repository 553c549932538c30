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
  const int threads = RoundUpToWarp(params.f1);
  const size_t shared_bytes =
      sizeof(float) * (3 * params.f + 2 * params.f1 + params.K * (params.f + params.f1));
  TttScanKernel<<<num_segments * params.nh, threads, shared_bytes, stream>>>(
      params, segments, q, k, v, lr, state, offsets, out);
  return cudaGetLastError();
}

}  // namespace ttt::kernels::cuda
