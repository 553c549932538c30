// Row-wise normalisations: RMSNorm, and the TTT layer's output LayerNorm with its gate.
#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

__global__ void __launch_bounds__(1024)
    RmsNormKernel(const float* x, int D, const float* w, float eps, void* y, ElementType out_type) {
  __shared__ float scratch[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * D;
  float v[kRowSlice], gain[kRowSlice], sum = 0;
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    gain[m] = i < D ? w[i] : 0.0f;
  }
  WaitForPreviousKernel();
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    v[m] = i < D ? x[base + i] : 0.0f;
    sum += v[m] * v[m];
  }
  const float inv_rms = rsqrtf(BlockSum(sum, scratch) / D + eps);
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    if (i < D) Store(y, base + i, v[m] * inv_rms * gain[m], out_type);
  }
}

// A float of a row TttDecode is writing, once written (see PostNormGate's `awaited`).
__device__ __forceinline__ float LoadWritten(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ bool Pending(float v) { return __float_as_uint(v) == kRowPending; }

template <bool kAwaited>
__global__ void __launch_bounds__(1024)
    PostNormGateKernel(float* x, int D, const float* w, const float* b, float eps,
                       const float* gate, int64_t gate_ld, const Segment* awaited, void* y,
                       ElementType out_type) {
  __shared__ float scratch[kWarp];
  const int row = kAwaited ? awaited[blockIdx.x].row : static_cast<int>(blockIdx.x);
  const int64_t base = static_cast<int64_t>(row) * D;
  const float* gate_row = gate + static_cast<int64_t>(row) * gate_ld;
  // Everything the row needs is loaded before the first reduction waits; the weights, and the
  // gate with its gelu (written by an earlier kernel than the previous one, so complete by now:
  // see PostNormGate), before the previous kernel ends.
  float v[kRowSlice], gated[kRowSlice], gain[kRowSlice], shift[kRowSlice], sum = 0;
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    gain[m] = i < D ? w[i] : 0.0f;
    shift[m] = i < D ? b[i] : 0.0f;
    gated[m] = i < D && gate != nullptr ? Gelu(gate_row[i]) : 1.0f;
  }
  if constexpr (kAwaited) {
    // The row's floats as the decode kernel stores them: each asked for at once, then those
    // still pending again until written.
    const bool idle = awaited[blockIdx.x].count == 0;
#pragma unroll
    for (int m = 0; m < kRowSlice; ++m) {
      const int i = threadIdx.x + m * blockDim.x;
      v[m] = i < D && !idle ? LoadWritten(x + base + i) : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kRowSlice; ++m) {
      while (Pending(v[m])) {
        __nanosleep(128);
        v[m] = LoadWritten(x + base + threadIdx.x + m * blockDim.x);
      }
    }
  } else {
    WaitForPreviousKernel();
#pragma unroll
    for (int m = 0; m < kRowSlice; ++m) {
      const int i = threadIdx.x + m * blockDim.x;
      v[m] = i < D ? x[base + i] : 0.0f;
    }
  }
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) sum += v[m];
  const float mean = BlockSum(sum, scratch) / D;
  float squares = 0;
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    if (i < D) squares += (v[m] - mean) * (v[m] - mean);
  }
  const float inv_std = rsqrtf(BlockSum(squares, scratch) / D + eps);
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    if (i < D) {
      const float normed = (v[m] - mean) * inv_std * gain[m] + shift[m];
      Store(y, base + i, gate != nullptr ? gated[m] * normed : normed, out_type);
      if constexpr (kAwaited) x[base + i] = __uint_as_float(kRowPending);
    }
  }
  // This kernel ends after the decode kernel, as every kernel ends after the one before it (see
  // WaitForPreviousKernel): its last block, whose row that kernel writes last, waits for that
  // kernel's end and then lets the next kernel start. The others leave as soon as their rows are
  // made, so that the blocks after them find room on SMs the decode kernel still holds.
  if (kAwaited && blockIdx.x == gridDim.x - 1) WaitForPreviousKernel();
}

}  // namespace

cudaError_t RmsNorm(const float* x, int rows, int D, const float* weight, float eps, void* y,
                    ElementType out_type, cudaStream_t stream) {
  if (D > kMaxRowWidth) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return Launch(RmsNormKernel, rows, RowThreads(D), 0, stream, x, D, weight, eps, y, out_type);
}

cudaError_t PostNormGate(float* x, int rows, int D, const float* weight, const float* bias,
                         float eps, const float* gate, int64_t gate_ld, const Segment* awaited,
                         void* y, ElementType out_type, cudaStream_t stream) {
  if (D > kMaxRowWidth) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  // o_proj's product follows, with over 100 KB of shared memory a block; an SM holds blocks of one
  // carveout at a time, so that product's blocks start beside this kernel's last ones (and fetch
  // their first weights early) only if this kernel asks for the same (bench/README.md v14, v26).
  static const cudaError_t carveout = [] {
    for (auto kernel : {PostNormGateKernel<false>, PostNormGateKernel<true>}) {
      const cudaError_t set = cudaFuncSetAttribute(
          kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      if (set != cudaSuccess) return set;
    }
    return cudaSuccess;
  }();
  if (carveout != cudaSuccess) return carveout;
  return Launch(awaited != nullptr ? PostNormGateKernel<true> : PostNormGateKernel<false>, rows,
                RowThreads(D), 0, stream, x, D, weight, bias, eps, gate, gate_ld, awaited, y,
                out_type);
}

cudaError_t MakeProductInput(const ProductInput& input, int rows, int in, void* x,
                             ElementType type, cudaStream_t stream) {
  switch (input.kind) {
    case ProductInput::Kind::kRmsNorm:
      return RmsNorm(input.source, rows, in, input.weight, input.eps, x, type, stream);
    case ProductInput::Kind::kLayerNormGate:
      return PostNormGate(input.source, rows, in, input.weight, input.bias, input.eps, input.gate,
                          input.gate_ld, input.awaited, x, type, stream);
    case ProductInput::Kind::kRows:
      break;
  }
  return cudaErrorInvalidValue;  // Given rows are made already.
}

}  // namespace ttt::kernels::cuda
