// Where each part of a sequence's TTT state lives in its flat float32 buffer. Shared by backends so
// a saved state means the same thing everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "server/model/config.h"
#include "server/model/weights.h"

namespace ttt {

struct StateLayout {
  explicit StateLayout(const ModelConfig& config);

  // Offsets in floats from the start of a layer's block.
  size_t W1 = 0;          // [nh, f, f1]  θ0
  size_t b1 = 0;          // [nh, f1]
  size_t W2 = 0;          // [nh, f1, f]  (mlp)
  size_t b2 = 0;          // [nh, f]      (mlp)
  size_t pending_k = 0;   // [nh, K, f]   the open window's tokens: keys,
  size_t pending_g1 = 0;  // [nh, K, f1]  gradients at θ0,
  size_t pending_lr = 0;  // [nh, K]      inner learning rates,
  size_t pending_x2 = 0;  // [nh, K, f1]  hidden activations (mlp),
  size_t pending_g2 = 0;  // [nh, K, f]   second-layer gradients (mlp).
  size_t conv_pre = 0;    // [ck−1, D]    pre-conv input history (pre_conv)
  size_t conv_qk = 0;     // [ck−1, D]    shared q/k conv input history (share_qk)
  size_t layer_floats = 0;

  size_t W1_floats = 0;  // W1's length, nh·f·f1.
  // The conv histories a layer holds (conv_pre, conv_qk where present), each [ck−1, D].
  std::vector<size_t> conv_histories;
  size_t conv_history_rows = 0, conv_history_width = 0;  // ck−1, D.

  int64_t num_layers = 0;
  size_t total_floats() const { return layer_floats * num_layers; }
  size_t total_bytes() const { return total_floats() * sizeof(float); }
  size_t layer_offset(int64_t layer) const { return layer_floats * layer; }
};

// A sequence's state before its first token: θ0 from the checkpoint, the pending window and the
// conv histories zero.
std::vector<float> FreshState(const ModelConfig& config, const ModelWeights& weights,
                              const StateLayout& layout);

// θ0's W1 in halves, as the CUDA engine holds it with bf16 weights (TttStateOffsets::w1_split):
// each layer's W1 [nh, f, f1] becomes the upper 16 bits of every float, [nh, f, f1], then the
// lower 16 bits, [nh, f, f1], in the same bytes. Joined, the halves are the floats to the bit;
// the upper half alone is each float cut to bf16, which the decode step reads (half of θ0's
// bytes). Saved states hold W1 whole, so an engine that splits it joins it to save.
void SplitW1(const StateLayout& layout, std::span<float> state);
void JoinW1(const StateLayout& layout, std::span<float> state);

// The conv histories as the CUDA engine holds them: rings, the input at position s (its index
// from the sequence's start) in row s mod (ck−1), so that a token writes one row rather than
// shifting them all. Saved states hold them oldest first, so an engine that keeps rings orders
// them to save. `length` is the sequence's tokens so far (a history's newest input is at
// length − 1); rows before the sequence's start are zero in either form.
void RingConvHistories(const StateLayout& layout, int64_t length, std::span<float> state);
void OrderConvHistories(const StateLayout& layout, int64_t length, std::span<float> state);

// Layer `layer`'s τ_r = max(0, 1/(r+1) + learnable_token_idx[r]) for r < K (spec §3.4).
std::vector<float> WindowStepScales(const ModelConfig& config, const ModelWeights& weights,
                                    int64_t layer);

}  // namespace ttt
