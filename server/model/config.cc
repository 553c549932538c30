#include "server/model/config.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {
namespace {

using nlohmann::json;

absl::Status FieldError(std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: field '", AbslView(field), "' ", AbslView(what)));
}

// Each reader leaves *out unchanged when the field is absent.
absl::Status ReadInt(const json& j, const char* field, int64_t* out) {
  auto it = j.find(field);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  *out = it->get<int64_t>();
  return absl::OkStatus();
}

absl::Status ReadDouble(const json& j, const char* field, double* out) {
  auto it = j.find(field);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(field, "must be a number");
  *out = it->get<double>();
  return absl::OkStatus();
}

absl::Status ReadBool(const json& j, const char* field, bool* out) {
  auto it = j.find(field);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_boolean()) return FieldError(field, "must be true or false");
  *out = it->get<bool>();
  return absl::OkStatus();
}

absl::Status ReadString(const json& j, const char* field, std::string* out) {
  auto it = j.find(field);
  if (it == j.end()) return absl::OkStatus();
  if (!it->is_string()) return FieldError(field, "must be a string");
  *out = it->get<std::string>();
  return absl::OkStatus();
}

absl::Status RequirePositive(const char* field, int64_t value) {
  if (value <= 0) return FieldError(field, absl::StrCat("must be positive, got ", value));
  return absl::OkStatus();
}

absl::Status Validate(const ModelConfig& c) {
  TTT_RETURN_IF_ERROR(RequirePositive("vocab_size", c.vocab_size));
  TTT_RETURN_IF_ERROR(RequirePositive("hidden_size", c.hidden_size));
  TTT_RETURN_IF_ERROR(RequirePositive("intermediate_size", c.intermediate_size));
  TTT_RETURN_IF_ERROR(RequirePositive("num_hidden_layers", c.num_hidden_layers));
  TTT_RETURN_IF_ERROR(RequirePositive("num_attention_heads", c.num_attention_heads));
  TTT_RETURN_IF_ERROR(RequirePositive("mini_batch_size", c.mini_batch_size));
  TTT_RETURN_IF_ERROR(RequirePositive("conv_kernel", c.conv_kernel));
  if (c.hidden_size % c.num_attention_heads != 0) {
    return FieldError("hidden_size", absl::StrCat("(", c.hidden_size,
                                                  ") must be divisible by num_attention_heads (",
                                                  c.num_attention_heads, ")"));
  }
  if (c.head_dim() % 2 != 0) {
    return FieldError("num_attention_heads",
                      absl::StrCat("gives an odd head size ", c.head_dim(),
                                   "; RoPE needs an even one"));
  }
  if (!(c.rms_norm_eps > 0)) return FieldError("rms_norm_eps", "must be positive");
  if (!(c.rope_theta > 0)) return FieldError("rope_theta", "must be positive");
  if (!(c.ttt_base_lr >= 0)) return FieldError("ttt_base_lr", "must be non-negative");
  if (c.bos_token_id >= c.vocab_size) {
    return FieldError("bos_token_id",
                      absl::StrCat("(", c.bos_token_id, ") must be below vocab_size"));
  }
  if (c.eos_token_id >= c.vocab_size) {
    return FieldError("eos_token_id",
                      absl::StrCat("(", c.eos_token_id, ") must be below vocab_size"));
  }
  if (c.byte_token_offset) {
    if (*c.byte_token_offset < 0) return FieldError("byte_token_offset", "must be non-negative");
    if (*c.byte_token_offset + 256 > c.vocab_size) {
      return FieldError("byte_token_offset",
                        absl::StrCat("+ 256 byte ids exceed vocab_size (", c.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  ModelConfig c;
  TTT_RETURN_IF_ERROR(ReadInt(j, "vocab_size", &c.vocab_size));
  TTT_RETURN_IF_ERROR(ReadInt(j, "hidden_size", &c.hidden_size));
  TTT_RETURN_IF_ERROR(ReadInt(j, "intermediate_size", &c.intermediate_size));
  TTT_RETURN_IF_ERROR(ReadInt(j, "num_hidden_layers", &c.num_hidden_layers));
  TTT_RETURN_IF_ERROR(ReadInt(j, "num_attention_heads", &c.num_attention_heads));
  TTT_RETURN_IF_ERROR(ReadDouble(j, "rms_norm_eps", &c.rms_norm_eps));
  TTT_RETURN_IF_ERROR(ReadBool(j, "tie_word_embeddings", &c.tie_word_embeddings));
  TTT_RETURN_IF_ERROR(ReadDouble(j, "rope_theta", &c.rope_theta));
  TTT_RETURN_IF_ERROR(ReadBool(j, "use_gate", &c.use_gate));
  TTT_RETURN_IF_ERROR(ReadBool(j, "share_qk", &c.share_qk));
  TTT_RETURN_IF_ERROR(ReadBool(j, "pre_conv", &c.pre_conv));
  TTT_RETURN_IF_ERROR(ReadDouble(j, "ttt_base_lr", &c.ttt_base_lr));
  TTT_RETURN_IF_ERROR(ReadInt(j, "mini_batch_size", &c.mini_batch_size));
  TTT_RETURN_IF_ERROR(ReadInt(j, "conv_kernel", &c.conv_kernel));
  TTT_RETURN_IF_ERROR(ReadInt(j, "bos_token_id", &c.bos_token_id));
  TTT_RETURN_IF_ERROR(ReadInt(j, "eos_token_id", &c.eos_token_id));
  if (auto it = j.find("pad_token_id"); it != j.end() && !it->is_null()) {
    int64_t pad = 0;
    TTT_RETURN_IF_ERROR(ReadInt(j, "pad_token_id", &pad));
    c.pad_token_id = pad;
  }
  std::string act = "silu";
  TTT_RETURN_IF_ERROR(ReadString(j, "hidden_act", &act));
  if (act != "silu")
    return FieldError("hidden_act", absl::StrCat("'", act, "' is not supported (only 'silu')"));
  std::string layer_type = "linear";
  TTT_RETURN_IF_ERROR(ReadString(j, "ttt_layer_type", &layer_type));
  if (layer_type == "linear") {
    c.ttt_layer_type = TttLayerType::kLinear;
  } else if (layer_type == "mlp") {
    c.ttt_layer_type = TttLayerType::kMlp;
  } else {
    return FieldError("ttt_layer_type",
                      absl::StrCat("'", layer_type, "' is not 'linear' or 'mlp'"));
  }
  std::string tokenizer_type;
  TTT_RETURN_IF_ERROR(ReadString(j, "tokenizer_type", &tokenizer_type));
  if (tokenizer_type == "byte") {
    int64_t offset = 3;
    TTT_RETURN_IF_ERROR(ReadInt(j, "byte_token_offset", &offset));
    c.byte_token_offset = offset;
  } else if (!tokenizer_type.empty() && tokenizer_type != "sentencepiece") {
    return FieldError("tokenizer_type",
                      absl::StrCat("'", tokenizer_type, "' is not 'byte' or 'sentencepiece'"));
  }
  TTT_RETURN_IF_ERROR(Validate(c));
  return c;
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<ModelConfig> config = ParseModelConfig(text.str());
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(model_dir, "/", config.status().message()));
  }
  return config;
}

std::string ModelConfig::ToJson() const {
  json j = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_hidden_layers},
      {"num_attention_heads", num_attention_heads},
      {"rms_norm_eps", rms_norm_eps},
      {"tie_word_embeddings", tie_word_embeddings},
      {"rope_theta", rope_theta},
      {"use_gate", use_gate},
      {"share_qk", share_qk},
      {"pre_conv", pre_conv},
      {"ttt_layer_type", ttt_layer_type == TttLayerType::kMlp ? "mlp" : "linear"},
      {"ttt_base_lr", ttt_base_lr},
      {"mini_batch_size", mini_batch_size},
      {"conv_kernel", conv_kernel},
      {"bos_token_id", bos_token_id},
      {"eos_token_id", eos_token_id},
      {"hidden_act", "silu"},
  };
  j["pad_token_id"] = pad_token_id ? json(*pad_token_id) : json(nullptr);
  if (byte_token_offset) {
    j["tokenizer_type"] = "byte";
    j["byte_token_offset"] = *byte_token_offset;
  }
  return j.dump();
}

}  // namespace ttt
