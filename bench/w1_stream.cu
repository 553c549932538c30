// How fast the decode step's largest read can go: every (sequence, head)'s W1 (f × f floats,
// 16 KB at f = 64) read once, at the addresses the state pool gives them (one slot per sequence,
// a layer's heads side by side). Each variant only reads W1 and sums it, so the time is the memory
// system's for the access pattern, with none of the TTT kernel's arithmetic:
//   copy               cudaMemcpy of the same number of bytes (the roofline's bandwidth).
//   warp_per_item      a warp per (sequence, head), W1 copied to shared memory with cp.async all at
//                      once, as the decode kernel does; warp_per_half_item and _quarter_item: two
//                      or four warps an item, each copying its part (more warps an SM).
//   persistent         as many warps as are resident, each walking items a grid apart and copying
//                      its next item's W1 as soon as it has read the current one.
// Prints one JSON line per (preset, variant): bytes read, median time of 20 runs, GB/s.
//   ttt-w1-stream
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "server/util/percentile.h"

namespace {

using ttt::Median;

constexpr int kF = 64, kWarp = 32, kPieces = kF * kF / 4;  // float4 pieces of one W1.

struct Pattern {
  const char* preset;
  int sequences, heads;
  size_t slot_floats;  // Per sequence, as the 125m and 1b state pools lay them out.
};

__device__ const float4* W1Of(const float* pool, size_t slot_floats, int heads, int item) {
  return reinterpret_cast<const float4*>(pool + (item / heads) * slot_floats) +
         (item % heads) * kPieces;
}

// Reads this lane's share of W1 from shared memory, as the decode kernel's product does.
__device__ float SumOfShare(const float4* w1) {
  float sum = 0.0f;
  for (int i = threadIdx.x; i < kPieces; i += kWarp) {
    const float4 w = w1[i];
    sum += (w.x + w.y) + (w.z + w.w);
  }
  return sum;
}

// kSplit warps per item, each with 1/kSplit of W1 (more warps an SM, less in flight each).
template <int kSplit>
__global__ void WarpPerItem(const float* pool, size_t slot_floats, int heads, float* sums) {
  constexpr int kShare = kPieces / kSplit;
  extern __shared__ float4 w1[];
  const float4* W1 = W1Of(pool, slot_floats, heads, blockIdx.x / kSplit) +
                     (blockIdx.x % kSplit) * kShare;
  for (int i = threadIdx.x; i < kShare; i += kWarp) __pipeline_memcpy_async(&w1[i], &W1[i], 16);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncwarp();
  float sum = 0.0f;
  for (int i = threadIdx.x; i < kShare; i += kWarp) sum += w1[i].x + w1[i].w;
  if (sum == 12345.0f) sums[blockIdx.x / kSplit] = sum;  // Keeps the reads; never true here.
}

__global__ void Persistent(const float* pool, size_t slot_floats, int heads, int items,
                           float* sums) {
  extern __shared__ float4 w1[];
  auto copy = [&](int item) {
    if (item < items) {
      const float4* W1 = W1Of(pool, slot_floats, heads, item);
      for (int i = threadIdx.x; i < kPieces; i += kWarp)
        __pipeline_memcpy_async(&w1[i], &W1[i], 16);
    }
    __pipeline_commit();
  };
  copy(blockIdx.x);
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    __pipeline_wait_prior(0);
    __syncwarp();
    const float sum = SumOfShare(w1);
    __syncwarp();
    copy(item + gridDim.x);
    if (sum == 12345.0f) sums[item] = sum;
  }
}

template <typename Launch>
double MedianMs(Launch launch) {
  EventTimer timer;
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> times;
  for (int i = 0; i < 20; ++i) times.push_back(timer.Ms(launch));
  CHECK_CUDA(cudaGetLastError());
  return Median(times);
}

void Report(const Pattern& p, const char* variant, double bytes, double ms) {
  std::printf(
      "{\"preset\":\"%s\",\"sequences\":%d,\"heads\":%d,\"variant\":\"%s\",\"bytes_read\":%.0f,"
      "\"ms_p50\":%.4f,\"gb_per_s\":%.1f}\n",
      p.preset, p.sequences, p.heads, variant, bytes, ms, bytes / ms / 1e6);
}

}  // namespace

int main() {
  const Pattern patterns[] = {{"125m", 256, 12, 3806208 / 4}, {"1b", 256, 32, 20299776 / 4}};
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t shared = sizeof(float4) * kPieces;
  for (const Pattern& p : patterns) {
    const int items = p.sequences * p.heads;
    const size_t pool_floats = p.sequences * p.slot_floats;
    float *pool, *sums, *copy_to;
    CHECK_CUDA(cudaMalloc(&pool, pool_floats * sizeof(float)));
    CHECK_CUDA(cudaMemset(pool, 0, pool_floats * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&sums, items * sizeof(float)));
    const double bytes = static_cast<double>(items) * kPieces * sizeof(float4);
    CHECK_CUDA(cudaMalloc(&copy_to, static_cast<size_t>(bytes)));

    // cudaMemcpy moves the bytes twice (read and write): its time for half as many bytes.
    Report(p, "copy", bytes, MedianMs([&] {
             CHECK_CUDA(cudaMemcpyAsync(copy_to, pool, static_cast<size_t>(bytes) / 2,
                                        cudaMemcpyDeviceToDevice));
           }));
    Report(p, "warp_per_item", bytes, MedianMs([&] {
             WarpPerItem<1><<<items, kWarp, shared>>>(pool, p.slot_floats, p.heads, sums);
           }));
    Report(p, "warp_per_half_item", bytes, MedianMs([&] {
             WarpPerItem<2><<<2 * items, kWarp, shared / 2>>>(pool, p.slot_floats, p.heads, sums);
           }));
    Report(p, "warp_per_quarter_item", bytes, MedianMs([&] {
             WarpPerItem<4><<<4 * items, kWarp, shared / 4>>>(pool, p.slot_floats, p.heads, sums);
           }));
    int per_sm = 0;
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Persistent, kWarp, shared));
    Report(p, "persistent", bytes, MedianMs([&] {
             Persistent<<<std::min(items, sms * per_sm), kWarp, shared>>>(pool, p.slot_floats,
                                                                          p.heads, items, sums);
           }));
    CHECK_CUDA(cudaFree(pool));
    CHECK_CUDA(cudaFree(sums));
    CHECK_CUDA(cudaFree(copy_to));
  }
  return 0;
}
