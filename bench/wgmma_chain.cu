// How fast a consumer's wgmmas run on tiles already in shared memory, against their work: the
// main loop of our decode products (kernels/cuda/tensor_core_products.cu, bench/decode_gemm.cu)
// without the copies that feed it. bench/README.md v41 found that loop, alone, slower at 1b than
// cuBLASLt's whole product. Each block (one an SM) holds one 64-wide slice of K of x (64 rows)
// and of w (N rows), swizzled as TMA writes them, and its warpgroups multiply them again and
// again as a product's slices: four m64nNk16 a slice, committed as a group, then
// `wgmma.wait_group kInFlight`. The forms:
//   N              64 × N tiles (the engine's are 32 to 128 wide);
//   chains         accumulators a warpgroup keeps, slice s adding into chain s % chains (the
//                  decode products keep one, so each slice's wgmmas follow the last's);
//   in flight      groups left pending at each wait (the products leave one);
//   warpgroups     consumers a block (the products' "two consumers" take K's slices in turn).
// Prints one JSON line per form: the launch's µs and, per SM, cycles per m64nNk16 against the
// N / 2 cycles the tensor cores need for it at their peak rate (1,024·N multiply-adds at 2,048 a
// cycle), medians of 11 launches.
//   ttt-wgmma-chain
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "kernels/cuda/wgmma.cuh"
#include "server/util/percentile.h"

namespace {

using ttt::Median;
using bf16 = __nv_bfloat16;
using ttt::kernels::cuda::kSliceIn;
using ttt::kernels::cuda::SwizzledTile;
using ttt::kernels::cuda::WgmmaOfWidth;

constexpr int kSlices = 2048;  // A product's K of 131,072: long enough that the loop dominates.

template <int kN, int kChains, int kInFlight, int kWarpgroups>
__global__ void __launch_bounds__(128 * kWarpgroups, 1)
    WgmmaChain(int slices, float* sink, long long* cycles) {
  extern __shared__ unsigned char shared[];
  // Swizzled tiles start on 1,024-byte boundaries (the launch adds that much room). Their values
  // are whatever shared memory holds: the time does not depend on them.
  bf16* x =
      reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(shared) + 1023) & ~uintptr_t{1023});
  bf16* w = x + 64 * kSliceIn;
  float d[kChains][kN / 2] = {};
  __syncthreads();
  const long long start = clock64();
  for (int s = 0; s < slices; s += kChains) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int k = 0; k < kSliceIn; k += 16) {
        WgmmaOfWidth<kN>(d[c], SwizzledTile(x + k), SwizzledTile(w + k));
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kInFlight) : "memory");
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  const long long stop = clock64();
  float sum = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) sum += d[c][i];
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = sum;  // Keeps the products.
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

template <int kN, int kChains, int kInFlight, int kWarpgroups>
void Measure(int sms, float* sink, long long* cycles) {
  const auto kernel = WgmmaChain<kN, kChains, kInFlight, kWarpgroups>;
  const int shared_bytes = static_cast<int>(sizeof(bf16) * (64 + kN) * kSliceIn + 1024);
  CHECK_CUDA(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes));
  EventTimer timer;
  std::vector<double> us, per_step;
  std::vector<long long> block_cycles(sms);
  for (int run = 0; run < 12; ++run) {
    const float ms =
        timer.Ms([&] { kernel<<<sms, 128 * kWarpgroups, shared_bytes>>>(kSlices, sink, cycles); });
    CHECK_CUDA(cudaGetLastError());
    if (run == 0) continue;  // Warms up.
    us.push_back(1e3 * ms);
    CHECK_CUDA(
        cudaMemcpy(block_cycles.data(), cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost));
    const long long slowest = *std::max_element(block_cycles.begin(), block_cycles.end());
    // The SM's m64nNk16 steps: four a slice for each warpgroup.
    per_step.push_back(static_cast<double>(slowest) / (4.0 * kSlices * kWarpgroups));
  }
  const double peak_cycles = kN / 2.0;
  const double median = Median(per_step);
  std::printf(
      "{\"n\":%d,\"chains\":%d,\"in_flight\":%d,\"warpgroups\":%d,\"us_p50\":%.2f,"
      "\"cycles_per_step\":%.1f,\"peak_cycles_per_step\":%.1f,\"of_peak\":%.3f}\n",
      kN, kChains, kInFlight, kWarpgroups, Median(us), median, peak_cycles,
      peak_cycles / median);
}

}  // namespace

int main() {
  int device = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  float* sink;
  long long* cycles;
  CHECK_CUDA(cudaMalloc(&sink, sizeof(float) * sms * 256));
  CHECK_CUDA(cudaMalloc(&cycles, sizeof(long long) * sms));
  // As the decode products run it: one chain, one group in flight; one and two warpgroups.
  Measure<64, 1, 1, 1>(sms, sink, cycles);
  Measure<64, 1, 1, 2>(sms, sink, cycles);
  Measure<64, 1, 0, 1>(sms, sink, cycles);
  // More independent work in flight a warpgroup.
  Measure<64, 2, 1, 1>(sms, sink, cycles);
  Measure<64, 2, 2, 1>(sms, sink, cycles);
  Measure<64, 4, 3, 1>(sms, sink, cycles);
  Measure<64, 2, 1, 2>(sms, sink, cycles);
  // Other widths.
  Measure<32, 1, 1, 1>(sms, sink, cycles);
  Measure<32, 4, 3, 1>(sms, sink, cycles);
  Measure<128, 1, 1, 1>(sms, sink, cycles);
  Measure<128, 1, 1, 2>(sms, sink, cycles);
  Measure<128, 2, 1, 1>(sms, sink, cycles);
  Measure<256, 1, 1, 1>(sms, sink, cycles);
  Measure<256, 1, 1, 2>(sms, sink, cycles);
  CHECK_CUDA(cudaFree(cycles));
  CHECK_CUDA(cudaFree(sink));
  return 0;
}
