// The dense layers' products on cuBLASLt: y [rows, out] (+)= x [rows, in] · wᵀ, for row-major
// weights w [out, in] and inputs x in bf16 (or both in float32, multiplied in true float32: no
// TF32) and float32 outputs.
//
// Each shape's kernel is chosen once, by timing cuBLASLt's candidates on the device: at the few
// hundred rows of a decode step the heuristic's first choice is often not the fastest. The choice
// then stays, so a shape always computes the same way.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "absl/status/statusor.h"
#include "server/engine/cuda_support.h"

namespace ttt {

struct GemmShape {
  int64_t rows = 0, in = 0, out = 0;
  bool accumulate = false;  // y += x·wᵀ instead of y = x·wᵀ.

  friend bool operator<(const GemmShape& a, const GemmShape& b) {
    return std::tie(a.rows, a.in, a.out, a.accumulate) <
           std::tie(b.rows, b.in, b.out, b.accumulate);
  }
};

class CudaGemm {
 public:
  // Products on `stream`, with inputs in bf16 (or float32). Without `timed`, each shape takes
  // the heuristic's first choice.
  static absl::StatusOr<std::unique_ptr<CudaGemm>> Create(bool bfloat16, bool timed,
                                                          cudaStream_t stream);
  CudaGemm(const CudaGemm&) = delete;
  CudaGemm& operator=(const CudaGemm&) = delete;
  ~CudaGemm();

  // Chooses the kernel for `shape`, unless it is chosen already, by timing each candidate on x
  // and w; the candidates write to a buffer of their own. Waits for the stream; not while it is
  // being captured.
  absl::Status Tune(const GemmShape& shape, const void* x, const void* w);
  // Enqueues y (+)= x·wᵀ. A shape not tuned yet is tuned first, except while the stream is being
  // captured: that is an error (tune a graph's shapes before capturing it). Every pointer must be
  // 256-byte aligned, as cudaMalloc's are.
  absl::Status Run(const GemmShape& shape, const void* x, const void* w, float* y);

 private:
  // One shape's descriptors and chosen kernel.
  struct Plan {
    Plan() = default;
    Plan(const Plan&) = delete;
    Plan& operator=(const Plan&) = delete;
    ~Plan();
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  CudaGemm(bool bfloat16, bool timed, cudaStream_t stream)
      : bfloat16_(bfloat16), timed_(timed), stream_(stream) {}
  absl::Status Initialize();
  absl::StatusOr<std::unique_ptr<Plan>> Describe(const GemmShape& shape) const;
  absl::Status Enqueue(const Plan& plan, const GemmShape& shape, const cublasLtMatmulAlgo_t& algo,
                       const void* x, const void* w, float* y) const;

  bool bfloat16_;
  bool timed_;
  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
  cudaEvent_t timer_start_ = nullptr, timer_stop_ = nullptr;
  std::map<GemmShape, std::unique_ptr<Plan>> plans_;
};

}  // namespace ttt
