#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void RmsNormKernel(const float* x, int D, const float* w, float eps, void* y,
                              ElementType out_type) {
  __shared__ float scratch[kWarp];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * D;
  float sum = 0;
  for (int i = threadIdx.x; i < D; i += blockDim.x) sum += row[i] * row[i];
  const float inv_rms = rsqrtf(BlockSum(sum, scratch) / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    Store(y, static_cast<int64_t>(blockIdx.x) * D + i, row[i] * inv_rms * w[i], out_type);
  }
}

__global__ void LayerNormKernel(const float* x, int D, const float* w, const float* b, float eps,
                                float* y) {
  __shared__ float scratch[kWarp];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * D;
  float sum = 0;
  for (int i = threadIdx.x; i < D; i += blockDim.x) sum += row[i];
  const float mean = BlockSum(sum, scratch) / D;
  float sq = 0;
  for (int i = threadIdx.x; i < D; i += blockDim.x) sq += (row[i] - mean) * (row[i] - mean);
  const float inv_std = rsqrtf(BlockSum(sq, scratch) / D + eps);
  float* out = y + static_cast<int64_t>(blockIdx.x) * D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) out[i] = (row[i] - mean) * inv_std * w[i] + b[i];
}

}  // namespace

cudaError_t RmsNorm(const float* x, int rows, int D, const float* weight, float eps, void* y,
                    ElementType out_type, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  RmsNormKernel<<<rows, kThreads, 0, stream>>>(x, D, weight, eps, y, out_type);
  return cudaGetLastError();
}

cudaError_t LayerNorm(const float* x, int rows, int D, const float* weight, const float* bias,
                      float eps, float* y, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  LayerNormKernel<<<rows, kThreads, 0, stream>>>(x, D, weight, bias, eps, y);
  return cudaGetLastError();
}

}  // namespace ttt::kernels::cuda
