// The float32 weights of a TTT model, checked tensor by tensor against its config.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "server/model/config.h"
#include "server/model/safetensors.h"

namespace ttt {

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
};

// Every tensor the model of `config` needs (spec §5), in checkpoint order. An untied model's
// lm_head.weight is included; a tied model's is not (it reads the embedding instead).
std::vector<TensorSpec> ExpectedTensors(const ModelConfig& config);

// "model.layers.3.seq_modeling_block.W1".
std::string LayerTensorName(int64_t layer, std::string_view suffix);
inline constexpr char kTttBlock[] = "seq_modeling_block.";

class ModelWeights {
 public:
  // Loads model.safetensors, or the shards named by model.safetensors.index.json, from model_dir.
  // F32 tensors are used in place from the memory mapping; F16/BF16 are converted to float32.
  // Missing, misshapen or non-float tensors are errors naming the file and the tensor.
  static absl::StatusOr<ModelWeights> Load(const std::string& model_dir, const ModelConfig& config);

  // Random weights of a plausible scale (biases and norm gains away from 0 and 1, so that every
  // parameter matters), for tests and benchmarks. The same seed gives the same weights.
  static ModelWeights Random(const ModelConfig& config, uint64_t seed);

  ModelWeights(ModelWeights&&) = default;
  ModelWeights& operator=(ModelWeights&&) = default;

  // The tensor `name` (must be one of ExpectedTensors; tied lm_head resolves to the embedding).
  std::span<const float> Get(std::string_view name) const;
  const float* Data(std::string_view name) const { return Get(name).data(); }
  const float* LayerData(int64_t layer, std::string_view suffix) const {
    return Data(LayerTensorName(layer, suffix));
  }

  // A stable 64-bit identity of config and weights (sampled), naming the model in saved states.
  uint64_t fingerprint() const { return fingerprint_; }
  // Bytes of float32 weights.
  size_t total_bytes() const;

 private:
  ModelWeights() = default;
  void ComputeFingerprint(const ModelConfig& config);

  std::vector<std::unique_ptr<SafetensorsFile>> files_;  // Keeps in-place tensors mapped.
  std::vector<std::vector<float>> owned_;                // Converted or generated tensors.
  std::map<std::string, std::span<const float>, std::less<>> tensors_;
  uint64_t fingerprint_ = 0;
};

// 64-bit FNV-1a, for stable fingerprints and checksums (not for security).
uint64_t Fnv1a64(std::span<const std::byte> bytes, uint64_t hash = 0xcbf29ce484222325ull);

}  // namespace ttt
