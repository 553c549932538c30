// cuBLASLt's plan for a decode product in the standalone benchmark programs, made as
// server/engine/cuda_gemm.cc makes it: row-major y [rows, out] = x · wᵀ is column-major
// yᵀ = w · xᵀ, with w row-major [out, in] read as column-major [in, out] and transposed; bf16
// inputs, float32 sums and output; the heuristic's first kernel.
#pragma once

#include <cublasLt.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "bench/cuda_check.h"

struct LtPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t w, x, y;
  cublasLtMatmulAlgo_t algo;
};

// sm_target: kernels sized for that many SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET; 0, the
// default, for all of them).
inline LtPlan PlanLt(cublasLtHandle_t handle, int64_t rows, int64_t in, int64_t out,
                     size_t workspace_bytes, int32_t sm_target = 0) {
  LtPlan plan{};
  CHECK_CUBLAS(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T;
  CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                              sizeof(transpose)));
  CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET,
                                              &sm_target, sizeof(sm_target)));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.w, CUDA_R_16BF, in, out, in));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.x, CUDA_R_16BF, in, rows, in));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.y, CUDA_R_32F, out, rows, out));
  cublasLtMatmulPreference_t preference;
  CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t bytes = workspace_bytes;
  CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.w, plan.x, plan.y, plan.y,
                                              preference, 1, &result, &found));
  cublasLtMatmulPreferenceDestroy(preference);
  if (found == 0) {
    std::fprintf(stderr, "no cuBLASLt kernel for %lld × %lld by %lld\n",
                 static_cast<long long>(rows), static_cast<long long>(in),
                 static_cast<long long>(out));
    std::exit(1);
  }
  plan.algo = result.algo;
  return plan;
}

inline void DestroyLt(const LtPlan& plan) {
  cublasLtMatrixLayoutDestroy(plan.y);
  cublasLtMatrixLayoutDestroy(plan.x);
  cublasLtMatrixLayoutDestroy(plan.w);
  cublasLtMatmulDescDestroy(plan.desc);
}
