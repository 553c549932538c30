#include "server/model/presets.h"

#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"

namespace ttt {

absl::StatusOr<ModelConfig> PresetConfig(std::string_view preset, TttLayerType inner,
                                         bool mamba_backbone) {
  struct Size {
    std::string_view name;
    int64_t hidden, layers, heads, intermediate;
  };
  static constexpr Size kSizes[] = {{"125m", 768, 12, 12, 2048},
                                    {"350m", 1024, 24, 16, 2736},
                                    {"760m", 1536, 24, 16, 4096},
                                    {"1b", 2048, 24, 32, 5504}};
  for (const Size& size : kSizes) {
    if (size.name != preset) continue;
    ModelConfig c;
    c.hidden_size = size.hidden;
    c.num_hidden_layers = size.layers;
    c.num_attention_heads = size.heads;
    c.intermediate_size = size.intermediate;
    c.ttt_layer_type = inner;
    c.ttt_base_lr = inner == TttLayerType::kMlp ? 0.1 : 1.0;
    c.share_qk = c.use_gate = c.pre_conv = mamba_backbone;
    return c;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("preset '", AbslView(preset), "' is not one of 125m, 350m, 760m, 1b"));
}

}  // namespace ttt
