// A loaded model: its config, weights and (optional) tokenizer.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/model/config.h"
#include "server/model/tokenizer.h"
#include "server/model/weights.h"

namespace ttt {

struct Model {
  std::string name;  // The model directory's base name.
  ModelConfig config;
  ModelWeights weights;
  std::unique_ptr<Tokenizer> tokenizer;  // nullptr: the model takes token ids only.
};

// Loads config.json, the safetensors weights and the tokenizer from `model_dir`.
absl::StatusOr<std::shared_ptr<const Model>> LoadModel(const std::string& model_dir);

}  // namespace ttt
