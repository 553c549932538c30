// Device helpers shared by the kernels: reductions, activations, typed stores.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda_ops.h"

namespace ttt::kernels::cuda {

inline constexpr int kWarp = 32;

__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32 floats;
// every thread gets the result. Callable repeatedly (it syncs before reusing scratch).
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int warps = blockDim.x / kWarp;
  v = WarpSum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(total);
}

__device__ __forceinline__ float Gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

// The feed-forward's activation: silu(gate) · up (on the host too, for the checks of kernels).
// On the device with the fast exp and division, whose few ulp of error moved no test's figure
// but one argmax in 5,120: IEEE's took 1.7% of a 125m batch-256 step, in gate_up's epilogue
// (bench/README.md v42).
__host__ __device__ __forceinline__ float Swish(float gate, float up) {
#ifdef __CUDA_ARCH__
  return __fdividef(gate, 1.0f + __expf(-gate)) * up;
#else
  return gate / (1.0f + expf(-gate)) * up;
#endif
}

__device__ __forceinline__ float GeluDerivative(float x) {
  const float t = tanhf(0.7978845608f * (x + 0.044715f * x * x * x));
  return 0.5f * x * (1.0f - t * t) * (0.7978845608f + 0.1070322243f * x * x) + 0.5f * (1.0f + t);
}

// Four floats at a time.
__device__ __forceinline__ float Sum4(float4 v) { return (v.x + v.y) + (v.z + v.w); }
__device__ __forceinline__ float Dot4(float4 a, float4 b) {
  return (a.x * b.x + a.y * b.y) + (a.z * b.z + a.w * b.w);
}
__device__ __forceinline__ float4 operator*(float s, float4 v) {
  return make_float4(s * v.x, s * v.y, s * v.z, s * v.w);
}
__device__ __forceinline__ float4 operator+(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ float4 operator-(float4 a, float4 b) {
  return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
__device__ __forceinline__ float4 operator*(float4 a, float4 b) {
  return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w);
}
__device__ __forceinline__ float4 Broadcast4(float s) { return make_float4(s, s, s, s); }

// A 16-byte vector of a product's operand (w, or x in w's type): eight bf16 or four float32,
// unpacked into floats. It is taken by value: from a reference into memory the compiler loads
// the pairs one by one, four 4-byte loads where one 16-byte load does.
template <typename T>
inline constexpr int kElements = 16 / sizeof(T);

__device__ __forceinline__ void Unpack(uint4 v, float (&out)[8], const __nv_bfloat16*) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(pairs[i]);
    out[2 * i] = p.x;
    out[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ void Unpack(uint4 v, float (&out)[4], const float*) {
  const float4 p = *reinterpret_cast<const float4*>(&v);
  out[0] = p.x, out[1] = p.y, out[2] = p.z, out[3] = p.w;
}

__device__ __forceinline__ void StoreAs(__nv_bfloat16* x, int i, float v) {
  x[i] = __float2bfloat16(v);
}
__device__ __forceinline__ void StoreAs(float* x, int i, float v) { x[i] = v; }

__device__ __forceinline__ void Store(void* out, int64_t i, float v, ElementType type) {
  if (type == ElementType::kBFloat16) {
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16(v);
  } else {
    static_cast<float*>(out)[i] = v;
  }
}

__device__ __forceinline__ float Load(const void* in, int64_t i, ElementType type) {
  if (type == ElementType::kBFloat16)
    return __bfloat162float(static_cast<const __nv_bfloat16*>(in)[i]);
  return static_cast<const float*>(in)[i];
}

__device__ __forceinline__ float* SequenceState(const StateAddress& state, int slot) {
  return state.states + static_cast<size_t>(slot) * state.slot_floats + state.layer_offset;
}

// Asks for the line holding p to be brought into L1, holding no register while it comes: for
// loads that can only be used after a reduction, issued before it.
__device__ __forceinline__ void PrefetchToL1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Programmatic dependent launch: every kernel here is launched by Launch(), which lets it start
// while the kernel before it on the stream is still finishing. So each kernel must call
// WaitForPreviousKernel() before it reads anything the previous kernel wrote or writes anything an
// earlier kernel reads; what it does before the wait (loading weights, state only it writes, or
// what kernels further back wrote) overlaps the previous kernel's tail. Right after the wait it
// lets the next kernel start the same way; so at most two kernels overlap, and every kernel
// before the previous one has ended when a kernel starts.
__device__ __forceinline__ void WaitForPreviousKernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
}

template <typename... Params, typename... Args>
cudaError_t Launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args... args) {
  cudaLaunchAttribute overlap{};
  overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &overlap;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

inline int RoundUpToWarp(int n) { return (n + kWarp - 1) / kWarp * kWarp; }

// Whether p may be read in 16-byte vectors.
inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Row-per-block kernels hold their row in registers: thread t has elements t + m·blockDim.x for
// m < kRowSlice, so each row is read once, with every load issued before the reduction waits.
inline constexpr int kRowSlice = 8;
inline constexpr int kMaxRowWidth = 1024 * kRowSlice;

// Threads per block for rows of width D: about four elements each.
inline int RowThreads(int D) {
  const int threads = RoundUpToWarp((D + 3) / 4);
  return threads < 1024 ? threads : 1024;
}

// Writes a thread's slice v of a row (starting at y's element `base`) normalised: element c as
// v · inv_rms · gain(m, c), gain read from wherever the kernel holds it.
template <int kSlice, typename Gain>
__device__ __forceinline__ void StoreNormedSlice(void* y, ElementType y_type, int64_t base, int D,
                                                 const float (&v)[kSlice], float inv_rms,
                                                 Gain gain) {
#pragma unroll
  for (int m = 0; m < kSlice; ++m) {
    const int c = threadIdx.x + m * blockDim.x;
    if (c < D) Store(y, base + c, v[m] * inv_rms * gain(m, c), y_type);
  }
}

}  // namespace ttt::kernels::cuda
