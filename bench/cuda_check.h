// For the standalone CUDA benchmark programs: a failed CUDA or cuBLAS call prints what failed
// and ends the program.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(call)                                                    \
  do {                                                                      \
    const cudaError_t status_ = (call);                                     \
    if (status_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(status_)); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

#define CHECK_CUBLAS(call)                                                     \
  do {                                                                         \
    const cublasStatus_t status_ = (call);                                     \
    if (status_ != CUBLAS_STATUS_SUCCESS) {                                    \
      std::fprintf(stderr, "%s: %s\n", #call, cublasGetStatusString(status_)); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)
