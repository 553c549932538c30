// The TTT model's operations on the CPU, float32, one per file under kernels/cpu/.
//
// Layout conventions shared by every backend:
// - activations are row-major [tokens, width]; `ld` is the distance between rows in floats;
// - linear weights are PyTorch's [out, in], applied as y = x Wᵀ;
// - heads are contiguous column blocks: channel h·f + d is head h, dim d;
// - a token's position in its mini-batch window is r = t mod K, t its absolute index.
#pragma once

#include <cmath>
#include <cstdint>

namespace ttt::kernels::cpu {

// y[n, out] = x[n, in] · wᵀ with w [out, in].
void Linear(const float* x, int64_t n, int64_t in, const float* w, int64_t out, float* y);

// Row-wise y = w ⊙ x / sqrt(mean(x²) + eps) over rows of width d.
void RmsNorm(const float* x, int64_t n, int64_t d, const float* w, float eps, float* y);

// Row-wise y = w ⊙ (x − μ)/sqrt(var + eps) + b (biased variance).
void LayerNorm(const float* x, int64_t n, int64_t d, const float* w, const float* b, float eps,
               float* y);

// Causal depthwise conv over n consecutive tokens of one sequence: y_t[c] = b[c] +
// Σ_j w[c, j] · x_{t−(ck−1)+j}[c]. `history` [ck−1, d] holds the inputs before x (oldest first,
// zeros at the sequence start); it is only read here, see AdvanceConvHistory.
void CausalConv(const float* x, int64_t n, int64_t d, const float* w, const float* b, int64_t ck,
                const float* history, float* y);
// Appends x [n, d] to `history`, keeping its last ck−1 rows.
void AdvanceConvHistory(const float* x, int64_t n, int64_t d, int64_t ck, float* history);

// RoPE's rotation at position p for each pair i < f/2, as the reference computes it (float32
// frequencies θ^(−2i/f) times the integer position): cos[i], sin[i].
void RopeCosSin(int64_t p, int64_t f, double theta, float* cos, float* sin);

// Interleaved RoPE in place on x [n, nh·f] (row stride ld), token i at position (start + i) mod K.
void ApplyRope(float* x, int64_t n, int64_t ld, int64_t nh, int64_t f, int64_t start, int64_t K,
               double theta);

// y = silu(gate) ⊙ up, elementwise over n values.
void SwiGluActivation(const float* gate, const float* up, int64_t n, float* y);

// The tanh approximation of gelu, and its derivative.
inline float Gelu(float x) {
  return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x)));
}
inline float GeluDerivative(float x) {
  const float t = std::tanh(0.7978845608f * (x + 0.044715f * x * x * x));
  return 0.5f * x * (1.0f - t * t) * (0.7978845608f + 0.1070322243f * x * x) + 0.5f * (1.0f + t);
}

// One TTT head's read-only parameters.
struct TttHeadParams {
  int64_t f = 0;   // Head size.
  int64_t f1 = 0;  // Inner hidden width: f (linear) or 4f (mlp).
  int64_t K = 16;  // Mini-batch size.
  bool mlp = false;
  const float* ln_weight = nullptr;  // [f] inner LayerNorm γ.
  const float* ln_bias = nullptr;    // [f] inner LayerNorm β.
  const float* tau = nullptr;        // [K] τ_r = max(0, 1/(r+1) + learnable_token_idx[r]).
  float ln_eps = 1e-6f;
};

// One TTT head's state in a sequence: θ0 at the last window boundary, and the window's pending
// tokens (key, gradients at θ0, learning rate), the first t mod K of which are valid.
struct TttHeadState {
  float* W1;  // [f, f1]
  float* b1;  // [f1]
  float* W2;  // [f1, f] (mlp)
  float* b2;  // [f] (mlp)
  float* k;   // [K, f]  keys after conv and RoPE.
  float* g1;  // [K, f1] ∂ℓ/∂z of the first (linear: only) layer.
  float* lr;  // [K]     per-token inner learning rate of this head.
  float* x2;  // [K, f1] gelu(k W1 + b1) at θ0 (mlp).
  float* g2;  // [K, f]  ∂ℓ/∂z of the second layer (mlp).
};

// Feeds n tokens at absolute positions start .. start+n−1 through one head (spec §3.6–3.7): every
// token's gradient is taken at θ0, its output row is the dual form over the window's tokens up to
// itself, and θ0 is rewritten after each window's last token. Any split of a sequence into calls
// gives the same outputs. q, k, v, out: rows of f floats, stride ld; lr: one per token, stride
// lr_stride (already base_lr · sigmoid(·) / f).
void TttHeadForward(const TttHeadParams& params, const TttHeadState& state, int64_t start,
                    int64_t n, const float* q, const float* k, const float* v, int64_t ld,
                    const float* lr, int64_t lr_stride, float* out);

}  // namespace ttt::kernels::cpu
