#include "server/engine/cuda_gemm.h"

#include <utility>

#include "kernels/cuda_ops.h"

namespace ttt {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

bool Aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 256 == 0; }

kernels::cuda::ElementType InputType(bool bfloat16) {
  return bfloat16 ? kernels::cuda::ElementType::kBFloat16 : kernels::cuda::ElementType::kFloat32;
}

}  // namespace

CudaGemm::Plan::~Plan() {
  if (y != nullptr) cublasLtMatrixLayoutDestroy(y);
  if (x != nullptr) cublasLtMatrixLayoutDestroy(x);
  if (w != nullptr) cublasLtMatrixLayoutDestroy(w);
  if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
}

absl::StatusOr<std::unique_ptr<CudaGemm>> CudaGemm::Create(bool bfloat16, cudaStream_t stream) {
  std::unique_ptr<CudaGemm> gemm(new CudaGemm(bfloat16, stream));
  TTT_RETURN_IF_ERROR(gemm->Initialize());
  return gemm;
}

absl::Status CudaGemm::Initialize() {
  TTT_CUBLAS(cublasLtCreate(&handle_));
  return workspace_.Reserve(kWorkspaceBytes);
}

CudaGemm::~CudaGemm() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<CudaGemm::Plan>> CudaGemm::MakePlan(const GemmShape& shape) const {
  auto plan = std::make_unique<Plan>();
  // Row-major y [rows, out] is column-major yᵀ [out, rows] = w · xᵀ, with w row-major [out, in]
  // read as column-major [in, out] and transposed.
  TTT_CUBLAS(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T;
  TTT_CUBLAS(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                            sizeof(transpose)));
  const cudaDataType_t input = bfloat16_ ? CUDA_R_16BF : CUDA_R_32F;
  TTT_CUBLAS(cublasLtMatrixLayoutCreate(&plan->w, input, shape.in, shape.out, shape.in));
  TTT_CUBLAS(cublasLtMatrixLayoutCreate(&plan->x, input, shape.in, shape.rows, shape.in));
  TTT_CUBLAS(cublasLtMatrixLayoutCreate(&plan->y, shape.bfloat16_y ? CUDA_R_16BF : CUDA_R_32F,
                                        shape.out, shape.rows, shape.out));

  cublasLtMatmulPreference_t preference = nullptr;
  TTT_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace_bytes = workspace_.bytes();
  cublasLtMatmulHeuristicResult_t chosen = {};
  int found = 0;
  cublasStatus_t status =
      cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes, sizeof(workspace_bytes));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->w, plan->x, plan->y, plan->y,
                                            preference, 1, &chosen, &found);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  TTT_CUBLAS(status);
  if (found == 0) {
    return absl::InternalError(absl::StrCat("cuBLASLt has no kernel for a GEMM of ", shape.rows,
                                            " × ", shape.in, " by ", shape.in, " × ", shape.out));
  }
  plan->algo = chosen.algo;
  return plan;
}

bool CudaGemm::TakesSkinnyGemm(const GemmShape& shape, const void* x, const void* w) const {
  const kernels::cuda::ProductInput given{.rows = x};
  return kernels::cuda::SkinnyGemmFits(shape.rows, given, shape.in, InputType(bfloat16_), w);
}

absl::Status CudaGemm::Run(const GemmShape& shape, const void* x, const void* w, void* y) {
  if (!Aligned(x) || !Aligned(w) || !Aligned(y)) {
    return absl::InternalError("GEMM operands must be 256-byte aligned");
  }
  if (shape.bfloat16_y && (shape.accumulate || !bfloat16_)) {
    return absl::InternalError("a bf16 GEMM output is for bf16 inputs and a plain store");
  }
  if (!shape.bfloat16_y && TakesSkinnyGemm(shape, x, w)) {
    const kernels::cuda::ProductInput given{.rows = x};
    TTT_CUDA(kernels::cuda::SkinnyGemm(shape.rows, given, w, shape.in, shape.out,
                                       InputType(bfloat16_),
                                       shape.accumulate ? kernels::cuda::ProductOutput::kAccumulate
                                                        : kernels::cuda::ProductOutput::kStore,
                                       static_cast<float*>(y), stream_));
    return absl::OkStatus();
  }
  auto found = plans_.find(shape);
  if (found == plans_.end()) {
    TTT_ASSIGN_OR_RETURN(std::unique_ptr<Plan> plan, MakePlan(shape));
    found = plans_.emplace(shape, std::move(plan)).first;
  }
  const Plan& plan = *found->second;
  const float alpha = 1.0f, beta = shape.accumulate ? 1.0f : 0.0f;
  TTT_CUBLAS(cublasLtMatmul(handle_, plan.desc, &alpha, w, plan.w, x, plan.x, &beta, y, plan.y, y,
                            plan.y, &plan.algo, workspace_.get(), workspace_.bytes(), stream_));
  return absl::OkStatus();
}

}  // namespace ttt
