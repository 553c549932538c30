#include "server/model/model.h"

#include <filesystem>

#include "server/util/status_macros.h"

namespace ttt {

absl::StatusOr<std::shared_ptr<const Model>> LoadModel(const std::string& model_dir) {
  TTT_ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(model_dir));
  TTT_ASSIGN_OR_RETURN(ModelWeights weights, ModelWeights::Load(model_dir, config));
  TTT_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tokenizer, LoadTokenizer(model_dir, config));
  std::string name = std::filesystem::path(model_dir).lexically_normal().filename().string();
  if (name.empty()) name = std::filesystem::path(model_dir).parent_path().filename().string();
  return std::make_shared<const Model>(
      Model{std::move(name), std::move(config), std::move(weights), std::move(tokenizer)});
}

}  // namespace ttt
