// Picks and builds the engine for a model: the CUDA backend when a GPU is there, else the CPU one.
#pragma once

#include <memory>
#include <string>

#include "server/engine/cuda_engine.h"
#include "server/engine/engine.h"
#include "server/model/model.h"

namespace ttt {

struct EngineOptions {
  std::string backend = "auto";  // "auto", "cpu" or "cuda".
  WeightPrecision precision = WeightPrecision::kBFloat16;  // CUDA only; the CPU engine is float32.
  int64_t max_sequences = 0;          // 0: as many as the state pool holds (CPU: no limit).
  double state_pool_fraction = 0.5;   // CUDA: share of free GPU memory for states.
  int64_t prefill_tokens_per_step = 0;  // CUDA: prepare at start for steps of this budget.
  // CUDA: how a single sequence decodes (see CudaEngineOptions).
  CudaEngineOptions::SingleSequenceKernel single_sequence_kernel =
      CudaEngineOptions::SingleSequenceKernel::kWhereFaster;
};

// InvalidArgument for an unknown backend; FailedPrecondition when "cuda" is asked for and this
// build or machine has none.
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(std::shared_ptr<const Model> model,
                                                     const EngineOptions& options);

// Parses "bf16" / "f32".
absl::StatusOr<WeightPrecision> ParseWeightPrecision(std::string_view text);

// Parses "auto" (the engine times both paths), "on" (the one kernel where the model fits it) and
// "off".
absl::StatusOr<CudaEngineOptions::SingleSequenceKernel> ParseSingleSequenceKernel(
    std::string_view text);

}  // namespace ttt
