#include "server/model/weights.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {
namespace {

constexpr std::string_view kEmbedding = "model.embed_tokens.weight";
constexpr std::string_view kLmHead = "lm_head.weight";

bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

// The index of the first NaN or infinity in `values`, if any: those whose exponent bits are all
// set. A block at a time, OR-ing a test of each value's bits (a loop the compiler vectorises,
// where one that may stop at any value is not), so a checkpoint is checked at memory speed.
std::optional<size_t> FirstNonFinite(std::span<const float> values) {
  constexpr uint32_t kExponent = 0x7f800000;
  constexpr size_t kBlock = 4096;
  for (size_t start = 0; start < values.size(); start += kBlock) {
    const std::span<const float> block =
        values.subspan(start, std::min(kBlock, values.size() - start));
    bool any = false;
    for (float v : block) any |= (std::bit_cast<uint32_t>(v) & kExponent) == kExponent;
    if (!any) continue;
    for (size_t i = 0; i < block.size(); ++i) {
      if (!std::isfinite(block[i])) return start + i;
    }
  }
  return std::nullopt;
}

// tensor name → shard file, from model.safetensors.index.json.
absl::StatusOr<std::map<std::string, std::string>> ReadShardIndex(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  auto index = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
      !index["weight_map"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no 'weight_map' object"));
  }
  std::map<std::string, std::string> weight_map;
  for (auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": weight_map entry '", name, "' is not a file name"));
    }
    weight_map[name] = file.get<std::string>();
  }
  return weight_map;
}

}  // namespace

uint64_t Fnv1a64(std::span<const std::byte> bytes, uint64_t hash) {
  for (std::byte b : bytes) {
    hash ^= static_cast<uint8_t>(b);
    hash *= 0x100000001b3ull;
  }
  return hash;
}

std::string LayerTensorName(int64_t layer, std::string_view suffix) {
  return absl::StrCat("model.layers.", layer, ".", AbslView(suffix));
}

std::vector<TensorSpec> ExpectedTensors(const ModelConfig& c) {
  const int64_t D = c.hidden_size, V = c.vocab_size, I = c.intermediate_size;
  const int64_t nh = c.num_attention_heads, f = c.head_dim(), f1 = c.inner_width();
  const int64_t ck = c.conv_kernel, K = c.mini_batch_size;
  std::vector<TensorSpec> specs = {{std::string(kEmbedding), {V, D}}};
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    auto add = [&](std::string_view suffix, std::vector<int64_t> shape) {
      specs.push_back({LayerTensorName(i, suffix), std::move(shape)});
    };
    auto ttt = [&](std::string_view name, std::vector<int64_t> shape) {
      add(absl::StrCat(kTttBlock, AbslView(name)), std::move(shape));
    };
    if (c.pre_conv) {
      add("conv.norm.weight", {D});
      add("conv.conv.weight", {D, 1, ck});
      add("conv.conv.bias", {D});
    }
    add("seq_norm.weight", {D});
    ttt("q_proj.weight", {D, D});
    if (c.share_qk) {
      ttt("conv_q.weight", {D, 1, ck});
      ttt("conv_q.bias", {D});
      ttt("conv_k.weight", {D, 1, ck});
      ttt("conv_k.bias", {D});
    } else {
      ttt("k_proj.weight", {D, D});
    }
    ttt("v_proj.weight", {D, D});
    ttt("o_proj.weight", {D, D});
    if (c.use_gate) ttt("g_proj.weight", {D, D});
    ttt("learnable_ttt_lr_weight", {nh, 1, D});
    ttt("learnable_ttt_lr_bias", {nh, 1});
    ttt("learnable_token_idx", {K});
    ttt("ttt_norm_weight", {nh, f});
    ttt("ttt_norm_bias", {nh, f});
    ttt("post_norm.weight", {D});
    ttt("post_norm.bias", {D});
    ttt("W1", {nh, f, f1});
    ttt("b1", {nh, 1, f1});
    if (c.ttt_layer_type == TttLayerType::kMlp) {
      ttt("W2", {nh, f1, f});
      ttt("b2", {nh, 1, f});
    }
    add("ffn_norm.weight", {D});
    add("mlp.gate_proj.weight", {I, D});
    add("mlp.up_proj.weight", {I, D});
    add("mlp.down_proj.weight", {D, I});
  }
  specs.push_back({"model.norm.weight", {D}});
  if (!c.tie_word_embeddings) specs.push_back({std::string(kLmHead), {V, D}});
  return specs;
}

absl::StatusOr<ModelWeights> ModelWeights::Load(const std::string& model_dir,
                                                const ModelConfig& config) {
  ModelWeights weights;
  // Which file holds each tensor.
  std::map<std::string, std::string> tensor_file;
  const std::string index_path = model_dir + "/model.safetensors.index.json";
  const bool sharded = FileExists(index_path) && !FileExists(model_dir + "/model.safetensors");
  if (sharded) {
    TTT_ASSIGN_OR_RETURN(tensor_file, ReadShardIndex(index_path));
  }
  std::map<std::string, const SafetensorsFile*> open_files;
  auto open = [&](const std::string& file_name) -> absl::StatusOr<const SafetensorsFile*> {
    if (auto it = open_files.find(file_name); it != open_files.end()) return it->second;
    TTT_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(model_dir + "/" + file_name));
    weights.files_.push_back(std::move(file));
    return open_files[file_name] = weights.files_.back().get();
  };

  for (const TensorSpec& spec : ExpectedTensors(config)) {
    std::string file_name = "model.safetensors";
    if (sharded) {
      auto it = tensor_file.find(spec.name);
      if (it == tensor_file.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index_path, ": tensor '", spec.name, "' is missing from weight_map"));
      }
      file_name = it->second;
    }
    TTT_ASSIGN_OR_RETURN(const SafetensorsFile* file, open(file_name));
    const TensorView* view = file->Find(spec.name);
    if (view == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(file->path(), ": tensor '", spec.name, "' is missing"));
    }
    if (view->shape != spec.shape) {
      return absl::InvalidArgumentError(absl::StrCat(
          file->path(), ": tensor '", spec.name, "' has shape ", ShapeString(view->shape),
          ", the config needs ", ShapeString(spec.shape)));
    }
    if (view->dtype != DType::kF32 && view->dtype != DType::kF16 && view->dtype != DType::kBF16) {
      return absl::InvalidArgumentError(absl::StrCat(file->path(), ": tensor '", spec.name,
                                                     "' has dtype ", DTypeName(view->dtype),
                                                     "; weights must be F32, F16 or BF16"));
    }
    const size_t n = static_cast<size_t>(view->num_elements());
    std::span<const float> values;
    if (view->dtype == DType::kF32 &&
        reinterpret_cast<uintptr_t>(view->bytes.data()) % alignof(float) == 0) {
      values = std::span<const float>(reinterpret_cast<const float*>(view->bytes.data()), n);
    } else {
      std::vector<float>& converted = weights.owned_.emplace_back(n);
      TTT_RETURN_IF_ERROR(ConvertToFloat32(*view, converted));
      values = converted;
    }
    if (const std::optional<size_t> at = FirstNonFinite(values)) {
      return absl::InvalidArgumentError(absl::StrCat(file->path(), ": tensor '", spec.name,
                                                     "' holds ", values[*at], " at element ", *at,
                                                     "; weights must be finite"));
    }
    weights.tensors_[spec.name] = values;
  }
  weights.ComputeFingerprint(config);
  return weights;
}

ModelWeights ModelWeights::Random(const ModelConfig& config, uint64_t seed) {
  // A 1b model has 1.4 billion values, ~25 s of one core's normal draws, so the values are drawn
  // by every core, a block at a time. Each block has its own generator, seeded from its tensor's
  // and its own index, so the weights do not depend on the number of threads.
  constexpr size_t kBlock = size_t{1} << 20;
  struct Block {
    std::span<float> values;
    float mean, stddev;
    std::seed_seq::result_type tensor, index;
  };
  ModelWeights weights;
  std::vector<Block> blocks;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    std::vector<float>& values = weights.owned_.emplace_back(NumElements(spec.shape));
    const std::string_view name = spec.name;
    auto ends_with = [&](std::string_view suffix) { return name.ends_with(suffix); };
    // Fan-in scaled so activations stay O(1) through the stack.
    double mean = 0, stddev = 1.0 / std::sqrt(double(spec.shape.back()));
    if (name == kEmbedding) {
      stddev = 1.0;
    } else if (ends_with("norm.weight") || ends_with("ttt_norm_weight")) {
      mean = 1.0, stddev = 0.1;
    } else if (ends_with("bias") || ends_with("b1") || ends_with("b2")) {
      stddev = 0.1;
    } else if (ends_with("learnable_token_idx")) {
      stddev = 0.05;
    } else if (ends_with("conv_q.weight") || ends_with("conv_k.weight") ||
               ends_with("conv.conv.weight")) {
      stddev = 0.5;
    } else if (ends_with("W1") || ends_with("W2")) {
      stddev = 1.0 / std::sqrt(double(spec.shape[1]));
    }
    const auto tensor = static_cast<std::seed_seq::result_type>(weights.owned_.size());
    for (size_t begin = 0; begin < values.size(); begin += kBlock) {
      const size_t size = std::min(kBlock, values.size() - begin);
      blocks.push_back({std::span(values).subspan(begin, size), float(mean), float(stddev), tensor,
                        static_cast<std::seed_seq::result_type>(begin / kBlock)});
    }
    weights.tensors_[spec.name] = values;
  }

  std::atomic<size_t> next_block{0};
  auto draw = [&] {
    for (size_t i = next_block++; i < blocks.size(); i = next_block++) {
      const Block& block = blocks[i];
      std::seed_seq block_seed{static_cast<std::seed_seq::result_type>(seed),
                               static_cast<std::seed_seq::result_type>(seed >> 32), block.tensor,
                               block.index};
      std::mt19937_64 rng(block_seed);
      std::normal_distribution<float> dist(block.mean, block.stddev);
      for (float& v : block.values) v = dist(rng);
    }
  };
  {
    std::vector<std::jthread> threads(std::max(1u, std::thread::hardware_concurrency()) - 1);
    for (std::jthread& thread : threads) thread = std::jthread(draw);
    draw();
  }
  weights.ComputeFingerprint(config);
  return weights;
}

std::span<const float> ModelWeights::Get(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end() && name == kLmHead) it = tensors_.find(kEmbedding);
  return it == tensors_.end() ? std::span<const float>() : it->second;
}

size_t ModelWeights::total_bytes() const {
  size_t bytes = 0;
  for (const auto& [name, values] : tensors_) bytes += values.size_bytes();
  return bytes;
}

void ModelWeights::ComputeFingerprint(const ModelConfig& config) {
  const std::string config_json = config.ToJson();
  uint64_t hash = Fnv1a64(std::as_bytes(std::span(config_json)));
  // Hashing every weight of a large model would slow start-up; up to 1024 evenly spaced values
  // per tensor tell apart any two trained or randomly initialised models.
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    std::span<const float> values = Get(spec.name);
    hash = Fnv1a64(std::as_bytes(std::span(spec.name)), hash);
    const size_t stride = std::max<size_t>(1, values.size() / 1024);
    for (size_t i = 0; i < values.size(); i += stride) {
      hash = Fnv1a64(std::as_bytes(values.subspan(i, 1)), hash);
    }
  }
  fingerprint_ = hash;
}

}  // namespace ttt
