#include "server/engine/state_layout.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace ttt {

StateLayout::StateLayout(const ModelConfig& c) : num_layers(c.num_hidden_layers) {
  const size_t nh = c.num_attention_heads, f = c.head_dim(), f1 = c.inner_width();
  const size_t K = c.mini_batch_size, D = c.hidden_size, history = c.conv_kernel - 1;
  const bool mlp = c.ttt_layer_type == TttLayerType::kMlp;
  size_t offset = 0;
  auto take = [&](size_t floats) {
    const size_t at = offset;
    offset += floats;
    return at;
  };
  W1_floats = nh * f * f1;
  W1 = take(W1_floats);
  b1 = take(nh * f1);
  W2 = take(mlp ? nh * f1 * f : 0);
  b2 = take(mlp ? nh * f : 0);
  pending_k = take(nh * K * f);
  pending_g1 = take(nh * K * f1);
  pending_lr = take(nh * K);
  pending_x2 = take(mlp ? nh * K * f1 : 0);
  pending_g2 = take(mlp ? nh * K * f : 0);
  conv_pre = take(c.pre_conv ? history * D : 0);
  conv_qk = take(c.share_qk ? history * D : 0);
  if (c.pre_conv) conv_histories.push_back(conv_pre);
  if (c.share_qk) conv_histories.push_back(conv_qk);
  conv_history_rows = history;
  conv_history_width = D;
  layer_floats = offset;
}

std::vector<float> FreshState(const ModelConfig& c, const ModelWeights& weights,
                              const StateLayout& layout) {
  std::vector<float> state(layout.total_floats(), 0.0f);
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    float* base = state.data() + layout.layer_offset(layer);
    auto copy = [&](const char* name, size_t offset) {
      std::span<const float> values =
          weights.Get(LayerTensorName(layer, std::string(kTttBlock) + name));
      std::copy(values.begin(), values.end(), base + offset);
    };
    copy("W1", layout.W1);
    copy("b1", layout.b1);
    if (c.ttt_layer_type == TttLayerType::kMlp) {
      copy("W2", layout.W2);
      copy("b2", layout.b2);
    }
  }
  return state;
}

void SplitW1(const StateLayout& layout, std::span<float> state) {
  const size_t n = layout.W1_floats;
  std::vector<uint32_t> bits(n);
  std::vector<uint16_t> halves(2 * n);
  for (int64_t layer = 0; layer < layout.num_layers; ++layer) {
    float* W1 = state.data() + layout.layer_offset(layer) + layout.W1;
    std::memcpy(bits.data(), W1, n * sizeof(uint32_t));
    for (size_t i = 0; i < n; ++i) {
      halves[i] = static_cast<uint16_t>(bits[i] >> 16);
      halves[n + i] = static_cast<uint16_t>(bits[i]);
    }
    std::memcpy(W1, halves.data(), 2 * n * sizeof(uint16_t));
  }
}

void JoinW1(const StateLayout& layout, std::span<float> state) {
  const size_t n = layout.W1_floats;
  std::vector<uint16_t> halves(2 * n);
  std::vector<uint32_t> bits(n);
  for (int64_t layer = 0; layer < layout.num_layers; ++layer) {
    float* W1 = state.data() + layout.layer_offset(layer) + layout.W1;
    std::memcpy(halves.data(), W1, 2 * n * sizeof(uint16_t));
    for (size_t i = 0; i < n; ++i) bits[i] = uint32_t{halves[i]} << 16 | halves[n + i];
    std::memcpy(W1, bits.data(), n * sizeof(uint32_t));
  }
}

namespace {

// The ring's row of a history's oldest input after `length` tokens (position length − rows).
int64_t OldestRingRow(int64_t length, int64_t rows) {
  return ((length - rows) % rows + rows) % rows;
}

// Moves every conv history's rows: row i to row destination(i), for i < ck − 1.
template <typename Destination>
void PermuteConvHistories(const StateLayout& layout, std::span<float> state,
                          Destination destination) {
  const size_t rows = layout.conv_history_rows, width = layout.conv_history_width;
  std::vector<float> moved(rows * width);
  for (int64_t layer = 0; layer < layout.num_layers; ++layer) {
    for (size_t offset : layout.conv_histories) {
      float* history = state.data() + layout.layer_offset(layer) + offset;
      for (size_t i = 0; i < rows; ++i) {
        std::copy_n(history + i * width, width, moved.data() + destination(i) * width);
      }
      std::copy(moved.begin(), moved.end(), history);
    }
  }
}

}  // namespace

// Oldest first, row i holds the input at position length − (ck − 1) + i; in the ring, that
// position's row. Rows of positions below zero (zero in both forms) land on rows no input has
// reached yet.
void RingConvHistories(const StateLayout& layout, int64_t length, std::span<float> state) {
  const int64_t rows = static_cast<int64_t>(layout.conv_history_rows);
  if (rows == 0) return;
  const int64_t first = OldestRingRow(length, rows);
  PermuteConvHistories(layout, state, [&](size_t i) { return (first + i) % rows; });
}

void OrderConvHistories(const StateLayout& layout, int64_t length, std::span<float> state) {
  const int64_t rows = static_cast<int64_t>(layout.conv_history_rows);
  if (rows == 0) return;
  const int64_t first = OldestRingRow(length, rows);
  PermuteConvHistories(layout, state, [&](size_t i) { return (i + rows - first) % rows; });
}

std::vector<float> WindowStepScales(const ModelConfig& c, const ModelWeights& weights,
                                    int64_t layer) {
  const float* token_idx =
      weights.LayerData(layer, std::string(kTttBlock) + "learnable_token_idx");
  std::vector<float> tau(c.mini_batch_size);
  for (int64_t r = 0; r < c.mini_batch_size; ++r) {
    tau[r] = std::max(0.0f, 1.0f / static_cast<float>(r + 1) + token_idx[r]);
  }
  return tau;
}

}  // namespace ttt
