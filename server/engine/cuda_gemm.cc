#include "server/engine/cuda_gemm.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace ttt {
namespace {

// Enough for the split-K candidates; fixed, so that nothing is allocated while a graph is captured.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Candidates asked of the heuristic, and timed runs of each.
constexpr int kCandidates = 16;
constexpr int kTimedRuns = 5;

bool Aligned(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer) % 256 == 0; }

}  // namespace

CudaGemm::Plan::~Plan() {
  if (y != nullptr) cublasLtMatrixLayoutDestroy(y);
  if (x != nullptr) cublasLtMatrixLayoutDestroy(x);
  if (w != nullptr) cublasLtMatrixLayoutDestroy(w);
  if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
}

absl::StatusOr<std::unique_ptr<CudaGemm>> CudaGemm::Create(bool bfloat16, bool timed,
                                                           cudaStream_t stream) {
  std::unique_ptr<CudaGemm> gemm(new CudaGemm(bfloat16, timed, stream));
  TTT_RETURN_IF_ERROR(gemm->Initialize());
  return gemm;
}

absl::Status CudaGemm::Initialize() {
  TTT_CUBLAS(cublasLtCreate(&handle_));
  TTT_RETURN_IF_ERROR(workspace_.Reserve(kWorkspaceBytes));
  TTT_CUDA(cudaEventCreate(&timer_start_));
  TTT_CUDA(cudaEventCreate(&timer_stop_));
  return absl::OkStatus();
}

CudaGemm::~CudaGemm() {
  plans_.clear();
  if (timer_stop_ != nullptr) cudaEventDestroy(timer_stop_);
  if (timer_start_ != nullptr) cudaEventDestroy(timer_start_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::StatusOr<std::unique_ptr<CudaGemm::Plan>> CudaGemm::Describe(const GemmShape& shape) const {
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
  TTT_CUBLAS(cublasLtMatrixLayoutCreate(&plan->y, CUDA_R_32F, shape.out, shape.rows, shape.out));
  return plan;
}

absl::Status CudaGemm::Enqueue(const Plan& plan, const GemmShape& shape,
                               const cublasLtMatmulAlgo_t& algo, const void* x, const void* w,
                               float* y) const {
  const float alpha = 1.0f, beta = shape.accumulate ? 1.0f : 0.0f;
  TTT_CUBLAS(cublasLtMatmul(handle_, plan.desc, &alpha, w, plan.w, x, plan.x, &beta, y, plan.y, y,
                            plan.y, &algo, workspace_.get(), workspace_.bytes(), stream_));
  return absl::OkStatus();
}

absl::Status CudaGemm::Tune(const GemmShape& shape, const void* x, const void* w) {
  if (plans_.contains(shape)) return absl::OkStatus();
  TTT_ASSIGN_OR_RETURN(std::unique_ptr<Plan> plan, Describe(shape));

  cublasLtMatmulPreference_t preference = nullptr;
  TTT_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t workspace_bytes = workspace_.bytes();
  cublasLtMatmulHeuristicResult_t candidates[kCandidates] = {};
  int found = 0;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
      sizeof(workspace_bytes));
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->w, plan->x, plan->y,
                                            plan->y, preference, kCandidates, candidates, &found);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  TTT_CUBLAS(status);
  if (found == 0) {
    return absl::InternalError(absl::StrCat("cuBLASLt has no kernel for a GEMM of ", shape.rows,
                                            " × ", shape.in, " by ", shape.in, " × ", shape.out));
  }

  if (!timed_) {
    plan->algo = candidates[0].algo;
    plans_.emplace(shape, std::move(plan));
    return absl::OkStatus();
  }

  // The candidates write here, never to the caller's output.
  DeviceBuffer output;
  TTT_RETURN_IF_ERROR(output.Reserve(sizeof(float) * shape.rows * shape.out));
  TTT_CUDA(cudaMemsetAsync(output.get(), 0, output.bytes(), stream_));
  float best_ms = std::numeric_limits<float>::infinity();
  for (int i = 0; i < found; ++i) {
    const cublasLtMatmulAlgo_t& algo = candidates[i].algo;
    // A candidate that fails to run (the heuristic can offer ones that need more than the
    // workspace or the alignment) is passed over.
    if (!Enqueue(*plan, shape, algo, x, w, output.get<float>()).ok()) continue;
    TTT_CUDA(cudaEventRecord(timer_start_, stream_));
    for (int run = 0; run < kTimedRuns; ++run) {
      TTT_RETURN_IF_ERROR(Enqueue(*plan, shape, algo, x, w, output.get<float>()));
    }
    TTT_CUDA(cudaEventRecord(timer_stop_, stream_));
    TTT_CUDA(cudaEventSynchronize(timer_stop_));
    float ms = 0;
    TTT_CUDA(cudaEventElapsedTime(&ms, timer_start_, timer_stop_));
    if (ms < best_ms) {
      best_ms = ms;
      plan->algo = algo;
    }
  }
  if (best_ms == std::numeric_limits<float>::infinity()) {
    return absl::InternalError(absl::StrCat("no cuBLASLt kernel ran a GEMM of ", shape.rows, " × ",
                                            shape.in, " by ", shape.in, " × ", shape.out));
  }
  TTT_CUDA(cudaStreamSynchronize(stream_));  // The output buffer is freed next.
  plans_.emplace(shape, std::move(plan));
  return absl::OkStatus();
}

absl::Status CudaGemm::Run(const GemmShape& shape, const void* x, const void* w, float* y) {
  if (!Aligned(x) || !Aligned(w) || !Aligned(y)) {
    return absl::InternalError("GEMM operands must be 256-byte aligned");
  }
  auto plan = plans_.find(shape);
  if (plan == plans_.end()) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    TTT_CUDA(cudaStreamIsCapturing(stream_, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      return absl::InternalError(absl::StrCat("a GEMM of ", shape.rows, " rows was captured in a ",
                                              "graph before its kernel was chosen"));
    }
    TTT_RETURN_IF_ERROR(Tune(shape, x, w));
    plan = plans_.find(shape);
  }
  return Enqueue(*plan->second, shape, plan->second->algo, x, w, y);
}

}  // namespace ttt
