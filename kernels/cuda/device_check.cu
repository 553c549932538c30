#include <cuda_runtime.h>

#include "kernels/cuda_device.h"

namespace ttt::kernels::cuda {
namespace {

__global__ void SaxpyKernel(float a, const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

std::string ErrorText(cudaError_t error, const char* what) {
  return std::string(what) + ": " + cudaGetErrorString(error);
}

}  // namespace

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // Clear the sticky "no driver" error.
    return 0;
  }
  return count;
}

std::string Saxpy(float a, const float* x, float* y, int n) {
  const size_t bytes = sizeof(float) * n;
  float* dx = nullptr;
  float* dy = nullptr;
  std::string error;
  auto check = [&](cudaError_t status, const char* what) {
    if (status != cudaSuccess && error.empty()) error = ErrorText(status, what);
    return error.empty();
  };
  if (check(cudaMalloc(&dx, bytes), "cudaMalloc x") && check(cudaMalloc(&dy, bytes), "cudaMalloc y") &&
      check(cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice), "copy x") &&
      check(cudaMemcpy(dy, y, bytes, cudaMemcpyHostToDevice), "copy y")) {
    SaxpyKernel<<<(n + 255) / 256, 256>>>(a, dx, dy, n);
    if (check(cudaGetLastError(), "launch")) check(cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost), "copy back");
  }
  cudaFree(dx);
  cudaFree(dy);
  return error;
}

}  // namespace ttt::kernels::cuda
