#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

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
  if (check(cudaMalloc(&dx, bytes), "cudaMalloc x") &&
      check(cudaMalloc(&dy, bytes), "cudaMalloc y") &&
      check(cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice), "copy x") &&
      check(cudaMemcpy(dy, y, bytes, cudaMemcpyHostToDevice), "copy y")) {
    SaxpyKernel<<<(n + 255) / 256, 256>>>(a, dx, dy, n);
    if (check(cudaGetLastError(), "launch"))
      check(cudaMemcpy(y, dy, bytes, cudaMemcpyDeviceToHost), "copy back");
  }
  cudaFree(dx);
  cudaFree(dy);
  return error;
}

double MeasureCopyBandwidth(size_t bytes, std::string* error) {
  void* src = nullptr;
  void* dst = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  std::vector<float> times;
  auto check = [&](cudaError_t status, const char* what) {
    if (status != cudaSuccess && error->empty()) *error = ErrorText(status, what);
    return error->empty();
  };
  if (check(cudaMalloc(&src, bytes), "cudaMalloc") &&
      check(cudaMalloc(&dst, bytes), "cudaMalloc") &&
      check(cudaMemset(src, 1, bytes), "cudaMemset") && check(cudaEventCreate(&start), "event") &&
      check(cudaEventCreate(&stop), "event")) {
    for (int i = 0; i < 12 && error->empty(); ++i) {
      check(cudaEventRecord(start), "record");
      check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "copy");
      check(cudaEventRecord(stop), "record");
      check(cudaEventSynchronize(stop), "sync");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
      if (i >= 2) times.push_back(ms);  // The first copies warm up.
    }
  }
  if (start != nullptr) cudaEventDestroy(start);
  if (stop != nullptr) cudaEventDestroy(stop);
  cudaFree(src);
  cudaFree(dst);
  if (!error->empty() || times.empty()) return 0;
  std::sort(times.begin(), times.end());
  return 2.0 * bytes / (times[times.size() / 2] * 1e-3);
}

}  // namespace ttt::kernels::cuda
