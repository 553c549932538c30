// What the CUDA backend's parts share: statuses from CUDA and cuBLAS errors, and owned buffers of
// device or pinned host memory.
#pragma once

#include <cublas_api.h>
#include <cuda_runtime.h>

#include <cstring>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {

inline absl::Status CudaStatus(cudaError_t error, std::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  const auto code = error == cudaErrorMemoryAllocation ? absl::StatusCode::kResourceExhausted
                                                       : absl::StatusCode::kInternal;
  return absl::Status(
      code, absl::StrCat("CUDA error in ", AbslView(what), ": ", cudaGetErrorString(error)));
}

inline absl::Status CublasStatus(cublasStatus_t status, std::string_view what) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat("cuBLAS error in ", AbslView(what), ": ", cublasGetStatusString(status)));
}

#define TTT_CUDA(expr) TTT_RETURN_IF_ERROR(CudaStatus((expr), #expr))
#define TTT_CUBLAS(expr) TTT_RETURN_IF_ERROR(CublasStatus((expr), #expr))

enum class Memory { kDevice, kPinnedHost };

// Owns one allocation of device memory, or of page-locked host memory (copies from that are truly
// asynchronous and can sit in CUDA graphs).
template <Memory kMemory>
class CudaBuffer {
 public:
  CudaBuffer() = default;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  CudaBuffer(CudaBuffer&& other) noexcept { *this = std::move(other); }
  CudaBuffer& operator=(CudaBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~CudaBuffer() { Free(); }

  // Grows (never shrinks) to at least `bytes`; contents are not kept.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    Free();
    if constexpr (kMemory == Memory::kDevice) {
      TTT_CUDA(cudaMalloc(&data_, bytes));
    } else {
      TTT_CUDA(cudaMallocHost(&data_, bytes));
    }
    bytes_ = bytes;
    return absl::OkStatus();
  }

  // Grows to at least `bytes` keeping the contents: device memory is copied on `stream`, which
  // must have nothing else in flight.
  absl::Status GrowKeeping(size_t bytes, cudaStream_t stream) {
    if (bytes <= bytes_) return absl::OkStatus();
    CudaBuffer bigger;
    TTT_RETURN_IF_ERROR(bigger.Reserve(bytes));
    if (bytes_ > 0) {
      if constexpr (kMemory == Memory::kDevice) {
        TTT_CUDA(cudaMemcpyAsync(bigger.data_, data_, bytes_, cudaMemcpyDeviceToDevice, stream));
        TTT_CUDA(cudaStreamSynchronize(stream));
      } else {
        std::memcpy(bigger.data_, data_, bytes_);
      }
    }
    std::swap(*this, bigger);
    return absl::OkStatus();
  }

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Free() {
    if (data_ == nullptr) return;
    if constexpr (kMemory == Memory::kDevice) {
      cudaFree(data_);
    } else {
      cudaFreeHost(data_);
    }
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;
  size_t bytes_ = 0;
};

using DeviceBuffer = CudaBuffer<Memory::kDevice>;
using PinnedBuffer = CudaBuffer<Memory::kPinnedHost>;

}  // namespace ttt
