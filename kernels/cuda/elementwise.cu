// Embedding lookup, the feed-forward activation, row gathers, conversions and state copies.
#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) { return static_cast<int>((n + kThreads - 1) / kThreads); }

// Writes out[i] = value(i) for a row of D, with a block's threads. Each thread issues kLoadsAtOnce
// loads before its first store: the compiler may not move a load past a store to `out` (it cannot
// know they never alias), so a row loaded and stored an element at a time was D / kThreads
// dependent round trips to memory (the 1b preset's embedding rows: 6.1 µs, now 2.4; bench/
// README.md v35).
template <typename Value>
__device__ __forceinline__ void CopyRow(int D, float* out, Value value) {
  constexpr int kLoadsAtOnce = 8;  // A 2,048-wide row in one round.
  for (int first = threadIdx.x; first < D; first += kLoadsAtOnce * blockDim.x) {
    float values[kLoadsAtOnce];
#pragma unroll
    for (int m = 0; m < kLoadsAtOnce; ++m) {
      const int i = first + m * blockDim.x;
      values[m] = i < D ? value(i) : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < kLoadsAtOnce; ++m) {
      const int i = first + m * blockDim.x;
      if (i < D) out[i] = values[m];
    }
  }
}

__global__ void EmbeddingGatherKernel(const int32_t* tokens, const int32_t* chosen,
                                      const void* table, ElementType type, int D, float* h) {
  WaitForPreviousKernel();
  const int64_t row = blockIdx.x;
  const int32_t token = tokens[row] >= 0 ? tokens[row] : chosen[-tokens[row] - 1];
  const int64_t base = static_cast<int64_t>(token) * D;
  CopyRow(D, h + row * D, [&](int i) { return Load(table, base + i, type); });
}

// Output i is silu(gate_up[2i]) · gate_up[2i + 1]: rows of I outputs and 2I interleaved inputs
// line up, so the index runs over all rows at once.
__global__ void SwiGluKernel(const void* gate_up, ElementType in_type, int64_t n, void* out,
                             ElementType out_type) {
  WaitForPreviousKernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  Store(out, i, Swish(Load(gate_up, 2 * i, in_type), Load(gate_up, 2 * i + 1, in_type)), out_type);
}

// The (gate, up) pairs of outputs 4i .. 4i + 3: two 16-byte loads of float32, one of bf16.
__device__ __forceinline__ void LoadFourPairs(const float* gate_up, int64_t i, float (&v)[8]) {
  const float4 a = reinterpret_cast<const float4*>(gate_up)[2 * i];
  const float4 b = reinterpret_cast<const float4*>(gate_up)[2 * i + 1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void LoadFourPairs(const __nv_bfloat16* gate_up, int64_t i,
                                              float (&v)[8]) {
  Unpack(reinterpret_cast<const uint4*>(gate_up)[i], v, gate_up);
}

// Four outputs a thread when n % 4 == 0 (every known model): a quarter of the threads and
// instructions for the same bytes.
template <typename In>
__global__ void SwiGluBy4Kernel(const In* gate_up, int64_t n4, void* out, ElementType out_type) {
  WaitForPreviousKernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  float v[8];
  LoadFourPairs(gate_up, i, v);
  const float4 y = make_float4(Swish(v[0], v[1]), Swish(v[2], v[3]), Swish(v[4], v[5]),
                               Swish(v[6], v[7]));
  if (out_type == ElementType::kBFloat16) {
    __nv_bfloat162* pairs = static_cast<__nv_bfloat162*>(out) + 2 * i;
    pairs[0] = __floats2bfloat162_rn(y.x, y.y);
    pairs[1] = __floats2bfloat162_rn(y.z, y.w);
  } else {
    static_cast<float4*>(out)[i] = y;
  }
}

__global__ void GatherRowsKernel(const float* x, const int32_t* rows, int D, float* out) {
  WaitForPreviousKernel();
  const float* source = x + static_cast<int64_t>(rows[blockIdx.x]) * D;
  CopyRow(D, out + int64_t{blockIdx.x} * D, [&](int i) { return source[i]; });
}

__global__ void ToBFloat16Kernel(const float* x, int64_t n, __nv_bfloat16* y) {
  WaitForPreviousKernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(x[i]);
}

// Block (x, y) copies its kCopyVectors · blockDim.x vectors of source into slot y of the list,
// each thread issuing its loads before its stores (CopyRow says why).
constexpr int kCopyVectors = 4;
template <typename Vector>
__global__ void CopyToSlotsKernel(const Vector* source, int64_t slot_vectors, SlotList slots,
                                  Vector* pool) {
  WaitForPreviousKernel();
  Vector* slot = pool + slots.slots[blockIdx.y] * slot_vectors;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kCopyVectors * blockDim.x + threadIdx.x;
  Vector values[kCopyVectors];
#pragma unroll
  for (int m = 0; m < kCopyVectors; ++m) {
    const int64_t i = first + m * blockDim.x;
    if (i < slot_vectors) values[m] = source[i];
  }
#pragma unroll
  for (int m = 0; m < kCopyVectors; ++m) {
    const int64_t i = first + m * blockDim.x;
    if (i < slot_vectors) slot[i] = values[m];
  }
}

template <typename Vector>
cudaError_t LaunchCopyToSlots(const Vector* source, int64_t slot_vectors, const SlotList& slots,
                              Vector* pool, cudaStream_t stream) {
  const int64_t per_block = kCopyVectors * kThreads;
  const dim3 grid(static_cast<unsigned>((slot_vectors + per_block - 1) / per_block), slots.count);
  return Launch(CopyToSlotsKernel<Vector>, grid, kThreads, 0, stream, source, slot_vectors, slots,
                pool);
}

}  // namespace

cudaError_t EmbeddingGather(const int32_t* tokens, int rows, const int32_t* chosen,
                            const void* table, ElementType type, int D, float* h,
                            cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return Launch(EmbeddingGatherKernel, rows, kThreads, 0, stream, tokens, chosen, table, type, D,
                h);
}

cudaError_t SwiGlu(const void* gate_up, ElementType in_type, int rows, int I, void* out,
                   ElementType out_type, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * I;
  if (n == 0) return cudaSuccess;
  if (n % 4 != 0) {
    return Launch(SwiGluKernel, Blocks(n), kThreads, 0, stream, gate_up, in_type, n, out,
                  out_type);
  }
  if (in_type == ElementType::kBFloat16) {
    return Launch(SwiGluBy4Kernel<__nv_bfloat16>, Blocks(n / 4), kThreads, 0, stream,
                  static_cast<const __nv_bfloat16*>(gate_up), n / 4, out, out_type);
  }
  return Launch(SwiGluBy4Kernel<float>, Blocks(n / 4), kThreads, 0, stream,
                static_cast<const float*>(gate_up), n / 4, out, out_type);
}

cudaError_t GatherRows(const float* x, const int32_t* rows, int n, int D, float* out,
                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launch(GatherRowsKernel, n, kThreads, 0, stream, x, rows, D, out);
}

cudaError_t ConvertToBFloat16(const float* x, int64_t n, __nv_bfloat16* y, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return Launch(ToBFloat16Kernel, Blocks(n), kThreads, 0, stream, x, n, y);
}

cudaError_t CopyToSlots(const float* source, size_t slot_floats, const SlotList& slots, float* pool,
                        cudaStream_t stream) {
  if (slots.count == 0) return cudaSuccess;
  if (slot_floats % 4 == 0) {
    return LaunchCopyToSlots(reinterpret_cast<const float4*>(source),
                             static_cast<int64_t>(slot_floats / 4), slots,
                             reinterpret_cast<float4*>(pool), stream);
  }
  return LaunchCopyToSlots(source, static_cast<int64_t>(slot_floats), slots, pool, stream);
}

}  // namespace ttt::kernels::cuda
