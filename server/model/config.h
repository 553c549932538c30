// config.json of a TTT checkpoint (HF-style, model_type "ttt").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace ttt {

enum class TttLayerType { kLinear, kMlp };

struct ModelConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 2048;
  int64_t intermediate_size = 5504;
  int64_t num_hidden_layers = 24;
  int64_t num_attention_heads = 32;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = true;
  double rope_theta = 10000.0;
  bool use_gate = false;
  bool share_qk = false;
  bool pre_conv = false;
  TttLayerType ttt_layer_type = TttLayerType::kLinear;
  double ttt_base_lr = 1.0;
  int64_t mini_batch_size = 16;
  int64_t conv_kernel = 4;
  int64_t bos_token_id = 1;
  int64_t eos_token_id = 2;
  std::optional<int64_t> pad_token_id;
  // Set when the model declares the byte-level tokenizer ("tokenizer_type": "byte"): byte b is
  // token id byte_token_offset + b; ids below the offset are special tokens.
  std::optional<int64_t> byte_token_offset;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  // Width of the inner model's hidden layer: f for TTT-Linear, 4f for TTT-MLP.
  int64_t inner_width() const {
    return ttt_layer_type == TttLayerType::kMlp ? 4 * head_dim() : head_dim();
  }

  // Canonical JSON of every field above: stable across runs, used to fingerprint a model.
  std::string ToJson() const;
};

// Parses and validates config.json text. Unknown fields are ignored, missing ones take the defaults
// above, and an invalid value is an InvalidArgument error naming the field.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text);

// Reads `<model_dir>/config.json`.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

}  // namespace ttt
