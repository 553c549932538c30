#include "server/engine/engine_factory.h"

#include "absl/strings/str_cat.h"
#include "server/engine/cpu_engine.h"
#include "server/util/absl_string_view.h"

namespace ttt {

absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(std::shared_ptr<const Model> model,
                                                     const EngineOptions& options) {
  if (options.backend != "auto" && options.backend != "cpu" && options.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend: '", options.backend, "' is not auto, cpu or cuda"));
  }
#if TTT_WITH_CUDA
  if (options.backend == "cuda" || (options.backend == "auto" && CudaDeviceCount() > 0)) {
    return CreateCudaEngine(std::move(model),
                            {.precision = options.precision,
                             .max_sequences = options.max_sequences,
                             .state_pool_fraction = options.state_pool_fraction,
                             .prefill_tokens_per_step = options.prefill_tokens_per_step,
                             .single_sequence_kernel = options.single_sequence_kernel});
  }
#else
  if (options.backend == "cuda") {
    return absl::FailedPreconditionError("backend: this build has no CUDA support");
  }
#endif
  return std::unique_ptr<Engine>(
      std::make_unique<CpuEngine>(std::move(model), CpuEngineOptions{options.max_sequences}));
}

absl::StatusOr<WeightPrecision> ParseWeightPrecision(std::string_view text) {
  if (text == "bf16") return WeightPrecision::kBFloat16;
  if (text == "f32") return WeightPrecision::kFloat32;
  return absl::InvalidArgumentError(
      absl::StrCat("precision: '", AbslView(text), "' is not bf16 or f32"));
}

absl::StatusOr<CudaEngineOptions::SingleSequenceKernel> ParseSingleSequenceKernel(
    std::string_view text) {
  using Choice = CudaEngineOptions::SingleSequenceKernel;
  if (text == "auto") return Choice::kWhereFaster;
  if (text == "on") return Choice::kWhereItFits;
  if (text == "off") return Choice::kOff;
  return absl::InvalidArgumentError(
      absl::StrCat("single_sequence_kernel: '", AbslView(text), "' is not auto, on or off"));
}

}  // namespace ttt
