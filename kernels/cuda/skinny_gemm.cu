// The dense layers' products for a few rows (decode at small batch): y [rows, out] (+)= x · wᵀ
// with w row-major [out, in]. With so few rows a product is a stream of w's bytes, and what
// matters is keeping enough of them in flight:
// - each warp reads rows of w in 16-byte loads, kLoadsAhead of them per row in flight a lane,
//   and multiplies them into every input row (read from L1) at once;
// - wide rows are split among a block's warps, so that every warp's share is about one round of
//   loads, and the shares meet in shared memory;
// - the first loads go out before the previous kernel ends (programmatic launch).
#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kOutputsPerWarp = 2;  // x's loads are shared by two rows of w.
constexpr int kLoadsAhead = 8;

// A 16-byte vector of w or x: eight bf16 or four float32.
template <typename T>
struct Vector {
  static constexpr int kElements = 16 / sizeof(T);
};

__device__ __forceinline__ void Unpack(const uint4& v, float (&out)[8], const __nv_bfloat16*) {
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(pairs[i]);
    out[2 * i] = p.x;
    out[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ void Unpack(const uint4& v, float (&out)[4], const float*) {
  const float4 p = *reinterpret_cast<const float4*>(&v);
  out[0] = p.x, out[1] = p.y, out[2] = p.z, out[3] = p.w;
}

// A block's warps form kWarpsPerBlock / splits groups of `splits` warps, each group computing
// kOutputsPerWarp outputs: warp `part` of a group takes the part-th share of the row's vectors,
// lane l the vectors l, l + 32, … of that share.
template <typename T, int kRows>
__global__ void __launch_bounds__(kWarpsPerBlock* kWarp)
    SkinnyGemmKernel(const uint4* x, const uint4* w, int vectors, int out, int splits, float* y,
                     bool accumulate) {
  constexpr int kElements = Vector<T>::kElements;
  __shared__ float partial[kWarpsPerBlock][kOutputsPerWarp][kRows];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int group = warp / splits, part = warp % splits;
  const int share = (vectors + splits - 1) / splits;
  const int begin = part * share, end = min(vectors, begin + share);
  const int first = (blockIdx.x * kWarpsPerBlock / splits + group) * kOutputsPerWarp;
  const uint4* w_rows[kOutputsPerWarp];
#pragma unroll
  for (int j = 0; j < kOutputsPerWarp; ++j) {
    // Outputs past the last read the last row again and write nothing.
    w_rows[j] = w + static_cast<int64_t>(min(first + j, out - 1)) * vectors;
  }

  uint4 wv[kOutputsPerWarp][kLoadsAhead];
  auto load_w = [&](int base) {
#pragma unroll
    for (int j = 0; j < kOutputsPerWarp; ++j) {
#pragma unroll
      for (int a = 0; a < kLoadsAhead; ++a) {
        const int v = base + a * kWarp + lane;
        wv[j][a] = v < end ? __ldcs(w_rows[j] + v) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  load_w(begin);  // w needs nothing from the previous kernel.
  WaitForPreviousKernel();
  float sum[kOutputsPerWarp][kRows] = {};
  for (int base = begin;;) {
#pragma unroll
    for (int a = 0; a < kLoadsAhead; ++a) {
      const int v = base + a * kWarp + lane;
      if (v >= end) break;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float xf[kElements];
        Unpack(__ldg(x + static_cast<int64_t>(r) * vectors + v), xf,
               static_cast<const T*>(nullptr));
#pragma unroll
        for (int j = 0; j < kOutputsPerWarp; ++j) {
          float wf[kElements];
          Unpack(wv[j][a], wf, static_cast<const T*>(nullptr));
#pragma unroll
          for (int e = 0; e < kElements; ++e) sum[j][r] = fmaf(xf[e], wf[e], sum[j][r]);
        }
      }
    }
    base += kLoadsAhead * kWarp;
    if (base >= end) break;
    load_w(base);
  }

#pragma unroll
  for (int j = 0; j < kOutputsPerWarp; ++j) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float total = WarpSum(sum[j][r]);
      if (lane == 0) partial[warp][j][r] = total;
    }
  }
  __syncthreads();
  if (part == 0 && lane < kOutputsPerWarp * kRows) {
    const int j = lane / kRows, r = lane % kRows, o = first + j;
    float total = 0;
    for (int p = 0; p < splits; ++p) total += partial[warp + p][j][r];
    if (o < out) {
      float& target = y[static_cast<int64_t>(r) * out + o];
      target = accumulate ? target + total : total;
    }
  }
}

template <typename T, int kRows>
cudaError_t LaunchRows(const void* x, const void* w, int in, int out, float* y, bool accumulate,
                       cudaStream_t stream) {
  // Split a row among as many warps (1, 2 or 4) as it takes rounds of loads.
  const int vectors = in / Vector<T>::kElements;
  const int rounds = (vectors + kLoadsAhead * kWarp - 1) / (kLoadsAhead * kWarp);
  const int splits = rounds <= 1 ? 1 : (rounds == 2 ? 2 : kWarpsPerBlock);
  const int outputs_per_block = kWarpsPerBlock / splits * kOutputsPerWarp;
  return Launch(SkinnyGemmKernel<T, kRows>, (out + outputs_per_block - 1) / outputs_per_block,
                kWarpsPerBlock * kWarp, 0, stream, static_cast<const uint4*>(x),
                static_cast<const uint4*>(w), vectors, out, splits, y, accumulate);
}

template <typename T>
cudaError_t LaunchFor(int rows, const void* x, const void* w, int in, int out, float* y,
                      bool accumulate, cudaStream_t stream) {
  switch (rows) {
    case 1: return LaunchRows<T, 1>(x, w, in, out, y, accumulate, stream);
    case 2: return LaunchRows<T, 2>(x, w, in, out, y, accumulate, stream);
    case 4: return LaunchRows<T, 4>(x, w, in, out, y, accumulate, stream);
    default: return cudaErrorNotSupported;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool SkinnyGemmFits(int rows, int in, ElementType type, const void* x, const void* w) {
  const int elements = type == ElementType::kBFloat16 ? Vector<__nv_bfloat16>::kElements
                                                      : Vector<float>::kElements;
  return rows >= 1 && rows <= kMaxSkinnyGemmRows && in % elements == 0 && Aligned16(x) &&
         Aligned16(w);
}

cudaError_t SkinnyGemm(int rows, const void* x, const void* w, int in, int out, ElementType type,
                       float* y, bool accumulate, cudaStream_t stream) {
  if (!SkinnyGemmFits(rows, in, type, x, w)) return cudaErrorNotSupported;
  if (out == 0) return cudaSuccess;
  return type == ElementType::kBFloat16
             ? LaunchFor<__nv_bfloat16>(rows, x, w, in, out, y, accumulate, stream)
             : LaunchFor<float>(rows, x, w, in, out, y, accumulate, stream);
}

}  // namespace ttt::kernels::cuda
