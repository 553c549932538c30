// The authors' model sizes (spec §1), for benchmarks and tests with random weights.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "server/model/config.h"

namespace ttt {

// "125m", "350m", "760m" or "1b" with the given inner model; `mamba_backbone` sets share_qk,
// use_gate and pre_conv together (the trained models' backbone) or clears them all.
absl::StatusOr<ModelConfig> PresetConfig(std::string_view preset, TttLayerType inner,
                                         bool mamba_backbone);

}  // namespace ttt
