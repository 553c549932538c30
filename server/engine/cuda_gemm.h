// The dense layers' products: y [rows, out] (+)= x [rows, in] · wᵀ, for row-major weights
// w [out, in] and inputs x in bf16 (or both in float32, multiplied in true float32: no TF32),
// summed in float32 and written as float32 (or, asked for, bf16). A few rows (decode at small
// batch) go to SkinnyGemm, which streams w at the memory's pace where cuBLASLt's kernels reach two
// thirds of it; the rest to cuBLASLt.
//
// Each cuBLASLt shape is planned once (its descriptors and the heuristic's kernel) and the plan
// kept, so a step's host work is one cublasLtMatmul per product and a shape always computes the
// same way.
// The workspace is fixed: nothing is allocated while a decode step is captured in a graph.
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
  bool bfloat16_y = false;  // y in bf16 instead of float32 (cuBLASLt only; not with accumulate).

  friend bool operator<(const GemmShape& a, const GemmShape& b) {
    return std::tie(a.rows, a.in, a.out, a.accumulate, a.bfloat16_y) <
           std::tie(b.rows, b.in, b.out, b.accumulate, b.bfloat16_y);
  }
};

class CudaGemm {
 public:
  // Products on `stream`, with inputs in bf16 (or float32).
  static absl::StatusOr<std::unique_ptr<CudaGemm>> Create(bool bfloat16, cudaStream_t stream);
  CudaGemm(const CudaGemm&) = delete;
  CudaGemm& operator=(const CudaGemm&) = delete;
  ~CudaGemm();

  // Enqueues y (+)= x·wᵀ, planning the shape on first use. Every pointer must be 256-byte
  // aligned, as cudaMalloc's are (the heuristic assumes it).
  absl::Status Run(const GemmShape& shape, const void* x, const void* w, void* y);

  // Whether Run gives a float32 product of this shape to SkinnyGemm, which writes float32 only
  // (bfloat16_y is ignored here).
  bool TakesSkinnyGemm(const GemmShape& shape, const void* x, const void* w) const;

 private:
  // One shape's descriptors and kernel.
  struct Plan {
    Plan() = default;
    Plan(const Plan&) = delete;
    Plan& operator=(const Plan&) = delete;
    ~Plan();
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t w = nullptr, x = nullptr, y = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  CudaGemm(bool bfloat16, cudaStream_t stream) : bfloat16_(bfloat16), stream_(stream) {}
  absl::Status Initialize();
  absl::StatusOr<std::unique_ptr<Plan>> MakePlan(const GemmShape& shape) const;

  bool bfloat16_;
  cudaStream_t stream_;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer workspace_;
  std::map<GemmShape, std::unique_ptr<Plan>> plans_;
};

}  // namespace ttt
