// The engine on an NVIDIA GPU: weights in bf16 (or float32 for exactness checks), every sequence's
// TTT state in float32 in a pool of fixed-size slots in device memory, dense layers as cuBLAS
// GEMMs and the TTT inner loop as fused kernels (kernels/cuda_ops.h).
#pragma once

#include <memory>

#include "server/engine/engine.h"
#include "server/model/model.h"

namespace ttt {

enum class WeightPrecision { kBFloat16, kFloat32 };

struct CudaEngineOptions {
  WeightPrecision precision = WeightPrecision::kBFloat16;
  // The state pool: `max_sequences` slots when set, else as many as `state_pool_bytes` hold, else
  // as many as `state_pool_fraction` of the device memory free after loading the weights.
  int64_t max_sequences = 0;
  size_t state_pool_bytes = 0;
  double state_pool_fraction = 0.5;
  int device = 0;
  // The scheduler's prefill budget (prompt tokens per step). When set, the engine prepares at
  // start for the steps it implies, with decode rows for up to kPreparedDecodeRows sequences:
  // buffers sized, every GEMM shape planned and run once (its kernel loaded), a decode graph
  // captured for every batch-size bucket, and a graph for every bucket of the steps that mix
  // prompts with decode rows (up to 1,024 rows and 16 prompts), so that no request pays for
  // those. Larger steps still run; they pay once, and mixed steps past those buckets, or past
  // buffers grown for them, launch kernel by kernel.
  int64_t prefill_tokens_per_step = 0;
  static constexpr int64_t kPreparedDecodeRows = 1024;
  // Decode steps of a single sequence can run every layer in one persistent kernel
  // (cu::SequenceStep, TTT-Linear models) instead of a kernel per stage, as larger batches run.
  // Which is faster depends on the model (bench/README.md, v20–v21: the one kernel is 8% faster
  // at 1b, 12% slower at 125m), so by default the engine times both at start wherever the model
  // fits the kernel and keeps the faster. Otherwise: never (kOff), wherever the model fits it, or
  // always, creation failing for a model it does not cover (kRequired).
  enum class SingleSequenceKernel { kWhereFaster, kOff, kWhereItFits, kRequired };
  SingleSequenceKernel single_sequence_kernel = SingleSequenceKernel::kWhereFaster;
};

// Number of CUDA devices usable by this process (0 without a driver or GPU).
int CudaDeviceCount();

// Loads `model` onto the GPU. Fails with a clear status when there is no GPU or too little memory
// for the weights and at least one state slot.
absl::StatusOr<std::unique_ptr<Engine>> CreateCudaEngine(std::shared_ptr<const Model> model,
                                                          const CudaEngineOptions& options = {});

}  // namespace ttt
