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
  StoreNormedSlice(y, out_type, base, D, v, inv_rms, [&](int m, int) { return gain[m]; });
}

__global__ void __launch_bounds__(1024)
    PostNormGateKernel(const float* x, int D, const float* w, const float* b, float eps,
                       const float* gate, int64_t gate_ld, void* y, ElementType out_type) {
  __shared__ float scratch[kWarp];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * D;
  const float* gate_row = gate + static_cast<int64_t>(blockIdx.x) * gate_ld;
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
  WaitForPreviousKernel();
#pragma unroll
  for (int m = 0; m < kRowSlice; ++m) {
    const int i = threadIdx.x + m * blockDim.x;
    v[m] = i < D ? x[base + i] : 0.0f;
    sum += v[m];
  }
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
    }
  }
}

}  // namespace

cudaError_t RmsNorm(const float* x, int rows, int D, const float* weight, float eps, void* y,
                    ElementType out_type, cudaStream_t stream) {
  if (D > kMaxRowWidth) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return Launch(RmsNormKernel, rows, RowThreads(D), 0, stream, x, D, weight, eps, y, out_type);
}

cudaError_t PostNormGate(const float* x, int rows, int D, const float* weight, const float* bias,
                         float eps, const float* gate, int64_t gate_ld, void* y,
                         ElementType out_type, cudaStream_t stream) {
  if (D > kMaxRowWidth) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  // o_proj's product follows, with over 100 KB of shared memory a block; an SM holds blocks of one
  // carveout at a time, so that product's blocks start beside this kernel's last ones (and fetch
  // their first weights early) only if this kernel asks for the same (bench/README.md v14, v26).
  static const cudaError_t carveout =
      cudaFuncSetAttribute(PostNormGateKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared);
  if (carveout != cudaSuccess) return carveout;
  return Launch(PostNormGateKernel, rows, RowThreads(D), 0, stream, x, D, weight, bias, eps, gate,
                gate_ld, y, out_type);
}

cudaError_t MakeProductInput(const ProductInput& input, int rows, int in, void* x,
                             ElementType type, cudaStream_t stream) {
  switch (input.kind) {
    case ProductInput::Kind::kRmsNorm:
      return RmsNorm(input.source, rows, in, input.weight, input.eps, x, type, stream);
    case ProductInput::Kind::kLayerNormGate:
      return PostNormGate(input.source, rows, in, input.weight, input.bias, input.eps, input.gate,
                          input.gate_ld, x, type, stream);
    case ProductInput::Kind::kRows:
      break;
  }
  return cudaErrorInvalidValue;  // Given rows are made already.
}

}  // namespace ttt::kernels::cuda
