// For the standalone CUDA benchmark programs: GPU work timed by a pair of CUDA events.
#pragma once

#include <cuda_runtime.h>

#include "bench/cuda_check.h"

// Two events, recorded around the work of each timing.
class EventTimer {
 public:
  EventTimer() {
    CHECK_CUDA(cudaEventCreate(&start_));
    CHECK_CUDA(cudaEventCreate(&stop_));
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  // Milliseconds from before the work `enqueue` puts on `stream` to its end, waited for.
  template <typename Enqueue>
  float Ms(Enqueue&& enqueue, cudaStream_t stream = nullptr) {
    CHECK_CUDA(cudaEventRecord(start_, stream));
    enqueue();
    CHECK_CUDA(cudaEventRecord(stop_, stream));
    CHECK_CUDA(cudaEventSynchronize(stop_));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};
