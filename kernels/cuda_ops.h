// The TTT model's operations on CUDA devices: launchers for the kernels under kernels/cuda/.
//
// Conventions (as kernels/cpu_ops.h): activations are row-major float32 [rows, width]; a batch
// stacks the tokens of several sequences ("segments") as consecutive rows; every launcher is
// asynchronous on `stream` and returns the launch error (cudaSuccess when queued). Inputs of
// cuBLAS GEMMs are `GemmInput` (bf16 or float32, as the weights); the GEMMs themselves are run by
// the engine.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace ttt::kernels::cuda {

// One sequence's tokens within a batch.
struct Segment {
  int32_t row;    // First row in the stacked activations.
  int32_t count;  // Tokens.
  int32_t slot;   // State slot.
  int32_t pad = 0;
  int64_t start;  // Absolute position of the first token in its sequence.
};

// Where a sequence's state lives: slot s, layer l starts at states + s·slot_floats + layer_offset.
struct StateAddress {
  float* states;
  size_t slot_floats;
  size_t layer_offset;
};

// Offsets in floats of a layer's TTT state parts (see server/engine/state_layout.h).
struct TttStateOffsets {
  size_t W1, b1, W2, b2, k, g1, lr, x2, g2;
};

enum class ElementType { kFloat32, kBFloat16 };

// table [V, D] (float or bf16, as `type`) → h [rows, D]; tokens are already validated.
cudaError_t EmbeddingGather(const int32_t* tokens, int rows, const void* table, ElementType type,
                            int D, float* h, cudaStream_t stream);

// Row-wise RMSNorm of x [rows, D] into y (float or bf16, as `out_type`).
cudaError_t RmsNorm(const float* x, int rows, int D, const float* weight, float eps, void* y,
                    ElementType out_type, cudaStream_t stream);

// Row-wise LayerNorm of x into y (float32), biased variance.
cudaError_t LayerNorm(const float* x, int rows, int D, const float* weight, const float* bias,
                      float eps, float* y, cudaStream_t stream);

// Causal depthwise conv over each segment's rows, continuing its sequence's history
// (history_offset within the layer's state, [ck−1, D]). `row_segment` maps row → segment index.
// accumulate: y += conv(x), else y = conv(x).
cudaError_t CausalConv(const float* x, int rows, int D, const float* weight, const float* bias,
                       int ck, const Segment* segments, const int32_t* row_segment,
                       StateAddress state, size_t history_offset, float* y, bool accumulate,
                       cudaStream_t stream);

// Appends each segment's rows of x to its history (after every conv reading it has run).
cudaError_t AdvanceConvHistory(const float* x, int num_segments, int D, int ck,
                               const Segment* segments, StateAddress state, size_t history_offset,
                               cudaStream_t stream);

// Interleaved RoPE in place on q and k [rows, nh·f], position (start + i) mod K per segment.
cudaError_t ApplyRope(float* q, float* k, int rows, int nh, int f, int K, float theta,
                      const Segment* segments, const int32_t* row_segment, cudaStream_t stream);

// lr [rows, nh] = base_lr · sigmoid(lr + bias[h]) / f, in place.
cudaError_t InnerLearningRate(float* lr, int rows, int nh, const float* bias, float base_lr,
                              int f, cudaStream_t stream);

struct TttScanParams {
  int nh, f, f1, K;
  bool mlp;
  const float* tau;        // [K]
  const float* ln_weight;  // [nh, f]
  const float* ln_bias;    // [nh, f]
  float ln_eps;
};

// The TTT inner loop (spec §3.6, §4) for every (segment, head): gradients at θ0, dual-form
// outputs, θ0 committed after each window's last token. q, k, v, out: [rows, nh·f]; lr [rows, nh].
cudaError_t TttScan(const TttScanParams& params, const Segment* segments, int num_segments,
                    const float* q, const float* k, const float* v, const float* lr,
                    StateAddress state, TttStateOffsets offsets, float* out, cudaStream_t stream);

// y = gelu(gate) ⊙ y, written to out (float or bf16).
cudaError_t GeluGate(const float* gate, const float* y, int64_t n, void* out, ElementType out_type,
                     cudaStream_t stream);

// out = silu(gate) ⊙ up (float or bf16).
cudaError_t SwiGlu(const float* gate, const float* up, int64_t n, void* out, ElementType out_type,
                   cudaStream_t stream);

// h += delta, elementwise.
cudaError_t AddInPlace(float* h, const float* delta, int64_t n, cudaStream_t stream);

// out[i, :] = x[rows[i], :].
cudaError_t GatherRows(const float* x, const int32_t* rows, int n, int D, float* out,
                       cudaStream_t stream);

// One row's sampling parameters (see server/engine/sampler.h; penalties are not applied here).
struct SamplingRow {
  float temperature;  // 0: greedy.
  int32_t top_k;      // 0: no limit.
  float top_p;
  float min_p;
  uint64_t seed;
  uint64_t step;      // Draw counter: the sequence's length when the token is chosen.
};

// ids[r], logprobs[r]: the token chosen from logits row r [rows, V] and its raw log-softmax.
cudaError_t SampleTokens(const float* logits, int rows, int V, const SamplingRow* params,
                         int32_t* ids, float* logprobs, cudaStream_t stream);

// float32 → bf16, elementwise (weights at load time).
cudaError_t ConvertToBFloat16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t stream);

}  // namespace ttt::kernels::cuda
