// A decode product's inputs on the device, for the standalone benchmark programs, drawn as a
// model's are: x [rows, in] of unit deviation (a normalized input) and w [out, in] of deviation
// 1/√in, so that the sums are of order one. With unit weights, 1b's sums had a deviation of 45 and
// one gate in 40 fell below −88, where expf(−gate) overflows and a SwiGLU's IEEE division takes
// its slow path (bench/README.md v42).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "bench/cuda_check.h"

struct ProductInputs {
  __nv_bfloat16* x = nullptr;
  __nv_bfloat16* w = nullptr;
};

// x, then w, drawn from rng.
inline ProductInputs UploadProductInputs(int64_t rows, int64_t in, int64_t out, std::mt19937& rng) {
  auto upload = [&rng](int64_t count, float deviation) {
    std::normal_distribution<float> normal(0.0f, deviation);
    std::vector<__nv_bfloat16> host(count);
    for (__nv_bfloat16& e : host) e = __float2bfloat16(normal(rng));
    __nv_bfloat16* device = nullptr;
    CHECK_CUDA(cudaMalloc(&device, host.size() * sizeof(__nv_bfloat16)));
    CHECK_CUDA(cudaMemcpy(device, host.data(), host.size() * sizeof(__nv_bfloat16),
                          cudaMemcpyHostToDevice));
    return device;
  };
  ProductInputs inputs;
  inputs.x = upload(rows * in, 1.0f);
  inputs.w = upload(out * in, 1.0f / std::sqrt(static_cast<float>(in)));
  return inputs;
}

inline void FreeProductInputs(const ProductInputs& inputs) {
  CHECK_CUDA(cudaFree(inputs.x));
  CHECK_CUDA(cudaFree(inputs.w));
}
