// ttt-random-model: writes a model directory with random weights at one of the authors' sizes,
// for load tests and benchmarks of the whole server.
//
//   ttt-random-model --preset 1b --inner linear --out /tmp/ttt-1b [--dtype bf16]
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <Eigen/Core>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "server/model/presets.h"
#include "server/model/safetensors.h"
#include "server/model/weights.h"
#include "server/tools/flag_names.h"
#include "server/util/status_macros.h"

ABSL_FLAG(std::string, preset, "125m", "125m, 350m, 760m or 1b.");
ABSL_FLAG(std::string, inner, "linear", "linear or mlp.");
ABSL_FLAG(std::string, backbone, "mamba", "mamba or transformer.");
ABSL_FLAG(std::string, dtype, "bf16", "Stored weight type: bf16 or f32.");
ABSL_FLAG(uint64_t, seed, 1, "Weights seed.");
ABSL_FLAG(std::string, out, "", "The model directory to write.");

namespace ttt {
namespace {

absl::Status Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out: a directory is needed");
  const std::string inner = absl::GetFlag(FLAGS_inner), dtype = absl::GetFlag(FLAGS_dtype);
  if (inner != "linear" && inner != "mlp")
    return absl::InvalidArgumentError("--inner: linear or mlp");
  if (dtype != "bf16" && dtype != "f32") return absl::InvalidArgumentError("--dtype: bf16 or f32");
  TTT_ASSIGN_OR_RETURN(
      ModelConfig config,
      PresetConfig(absl::GetFlag(FLAGS_preset),
                   inner == "mlp" ? TttLayerType::kMlp : TttLayerType::kLinear,
                   absl::GetFlag(FLAGS_backbone) == "mamba"));
  const ModelWeights weights = ModelWeights::Random(config, absl::GetFlag(FLAGS_seed));
  std::vector<std::vector<std::byte>> storage;
  std::vector<TensorToWrite> tensors;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    std::span<const float> values = weights.Get(spec.name);
    std::vector<std::byte>& bytes = storage.emplace_back();
    if (dtype == "bf16") {
      bytes.resize(values.size() * 2);
      for (size_t i = 0; i < values.size(); ++i) {
        const Eigen::bfloat16 v(values[i]);
        std::memcpy(&bytes[2 * i], &v, 2);
      }
    } else {
      auto raw = std::as_bytes(values);
      bytes.assign(raw.begin(), raw.end());
    }
    tensors.push_back({spec.name, dtype == "bf16" ? DType::kBF16 : DType::kF32, spec.shape, bytes});
  }
  std::filesystem::create_directories(out);
  std::ofstream(out + "/config.json") << config.ToJson() << "\n";
  TTT_RETURN_IF_ERROR(WriteSafetensors(out + "/model.safetensors", tensors));
  std::fprintf(stderr, "wrote %s (%s, %zu tensors)\n", out.c_str(), dtype.c_str(), tensors.size());
  return absl::OkStatus();
}

}  // namespace
}  // namespace ttt

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes a random-weight TTT model.\n  ttt-random-model --preset 1b --out DIR");
  ttt::ParseFlags(argc, argv);
  if (absl::Status status = ttt::Run(); !status.ok()) {
    std::fprintf(stderr, "ttt-random-model: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
