// The dense layers' products for a few rows (decode at small batch): p = x · wᵀ with w row-major
// [out, in]. With so few rows a product is a stream of w's bytes, and what matters is keeping
// enough of them in flight:
// - each warp reads rows of w in 16-byte loads, kLoadsAhead of them per row in flight a lane,
//   and multiplies them into every input row at once;
// - wide rows are split among a block's warps, so that every warp's share is about one round of
//   loads, and the shares meet in shared memory;
// - the first loads go out before the previous kernel ends (programmatic launch).
// A normed input row is made by each block into shared memory while those loads are in flight,
// so the norm costs no kernel of its own; and the SwiGLU of an interleaved gate/up product is
// taken where its two sums meet.
#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

using Kind = ProductInput::Kind;

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarp;
constexpr int kOutputsPerWarp = 2;  // x's loads are shared by two rows of w.
constexpr int kLoadsAhead = 8;
constexpr size_t kMaxMadeInputBytes = 48 * 1024;  // Shared memory without opting in.

int ElementsPerVector(ElementType type) {
  return type == ElementType::kBFloat16 ? kElements<__nv_bfloat16> : kElements<float>;
}

size_t ElementBytes(ElementType type) {
  return type == ElementType::kBFloat16 ? sizeof(__nv_bfloat16) : sizeof(float);
}

// The block writes the normed input row [in] into x, as RmsNormKernel and PostNormGateKernel
// compute it (in % 4 == 0; the sources 16-byte aligned).
template <typename T, Kind kInput>
__device__ void MakeInputRow(const ProductInput& input, int in, T* x) {
  __shared__ float scratch[kWarp];
  const int quads = in / 4;
  const float4* row = reinterpret_cast<const float4*>(input.source);
  const float4* weight = reinterpret_cast<const float4*>(input.weight);
  const float4* bias = reinterpret_cast<const float4*>(input.bias);
  float mean = 0;
  if constexpr (kInput == Kind::kLayerNormGate) {
    float sum = 0;
    for (int q = threadIdx.x; q < quads; q += kThreads) sum += Sum4(row[q]);
    mean = BlockSum(sum, scratch) / in;
  }
  float squares = 0;
  for (int q = threadIdx.x; q < quads; q += kThreads) {
    const float4 c = row[q] - Broadcast4(mean);
    squares += Dot4(c, c);
  }
  const float scale = rsqrtf(BlockSum(squares, scratch) / in + input.eps);

  const bool gated = kInput == Kind::kLayerNormGate && input.gate != nullptr;
  for (int q = threadIdx.x; q < quads; q += kThreads) {
    const float4 c = row[q] - Broadcast4(mean), g = weight[q];
    const float4 b = kInput == Kind::kLayerNormGate ? bias[q] : Broadcast4(0.0f);
    const float normed[4] = {c.x * scale * g.x + b.x, c.y * scale * g.y + b.y,
                             c.z * scale * g.z + b.z, c.w * scale * g.w + b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      StoreAs(x, 4 * q + i, gated ? Gelu(input.gate[4 * q + i]) * normed[i] : normed[i]);
    }
  }
}

// A block's warps form kWarpsPerBlock / splits groups of `splits` warps, each group computing
// kOutputsPerWarp outputs: warp `part` of a group takes the part-th share of the row's vectors,
// lane l the vectors l, l + 32, … of that share.
template <typename T, int kRows, Kind kInput, bool kSwiGlu>
__global__ void __launch_bounds__(kThreads)
    SkinnyGemmKernel(ProductInput input, const uint4* w, int vectors, int out, int splits,
                     void* y, bool accumulate) {
  static_assert(kInput == Kind::kRows || kRows == 1, "a norm's input is made for one row");
  extern __shared__ uint4 made_input[];  // [vectors]: the normed input row, made here.
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
  const uint4* x = static_cast<const uint4*>(input.rows);
  if constexpr (kInput != Kind::kRows) {
    MakeInputRow<T, kInput>(input, vectors * kElements<T>, reinterpret_cast<T*>(made_input));
    __syncthreads();
    x = made_input;
  }

  float sum[kOutputsPerWarp][kRows] = {};
  for (int base = begin;;) {
#pragma unroll
    for (int a = 0; a < kLoadsAhead; ++a) {
      const int v = base + a * kWarp + lane;
      if (v >= end) break;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float xf[kElements<T>];
        const int64_t at = static_cast<int64_t>(r) * vectors + v;
        if constexpr (kInput == Kind::kRows) {
          Unpack(__ldg(x + at), xf, static_cast<const T*>(nullptr));
        } else {
          Unpack(x[at], xf, static_cast<const T*>(nullptr));
        }
#pragma unroll
        for (int j = 0; j < kOutputsPerWarp; ++j) {
          float wf[kElements<T>];
          Unpack(wv[j][a], wf, static_cast<const T*>(nullptr));
#pragma unroll
          for (int e = 0; e < kElements<T>; ++e) sum[j][r] = fmaf(xf[e], wf[e], sum[j][r]);
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
  if (part != 0 || lane >= kRows || first >= out) return;
  const int r = lane;
  float total[kOutputsPerWarp] = {};
  for (int p = 0; p < splits; ++p) {
#pragma unroll
    for (int j = 0; j < kOutputsPerWarp; ++j) total[j] += partial[warp + p][j][r];
  }
  if constexpr (kSwiGlu) {  // first is even: (gate, up) of output first / 2.
    StoreAs(static_cast<T*>(y), r * (out / 2) + first / 2, Swish(total[0], total[1]));
  } else {
#pragma unroll
    for (int j = 0; j < kOutputsPerWarp; ++j) {
      if (first + j >= out) break;
      float& target = static_cast<float*>(y)[static_cast<int64_t>(r) * out + first + j];
      target = accumulate ? target + total[j] : total[j];
    }
  }
}

template <typename T, int kRows, Kind kInput, bool kSwiGlu>
cudaError_t LaunchKernel(const ProductInput& input, const void* w, int in, int out, void* y,
                         bool accumulate, cudaStream_t stream) {
  // Split a row among as many warps (1, 2 or 4) as it takes rounds of loads.
  const int vectors = in / kElements<T>;
  const int rounds = (vectors + kLoadsAhead * kWarp - 1) / (kLoadsAhead * kWarp);
  const int splits = rounds <= 1 ? 1 : (rounds == 2 ? 2 : kWarpsPerBlock);
  const int outputs_per_block = kWarpsPerBlock / splits * kOutputsPerWarp;
  const size_t made_bytes = kInput == Kind::kRows ? 0 : sizeof(T) * in;
  return Launch(SkinnyGemmKernel<T, kRows, kInput, kSwiGlu>,
                (out + outputs_per_block - 1) / outputs_per_block, kThreads, made_bytes, stream,
                input, static_cast<const uint4*>(w), vectors, out, splits, y, accumulate);
}

// The kernels built: given rows into a plain product; for one row, a norm's into a plain product
// or an RMSNorm's into the feed-forward's gate/up product.
template <typename T, int kRows>
cudaError_t LaunchForInput(const ProductInput& input, const void* w, int in, int out,
                           ProductOutput output, void* y, cudaStream_t stream) {
  const bool accumulate = output == ProductOutput::kAccumulate;
  const bool swiglu = output == ProductOutput::kSwiGlu;
  if (input.kind == Kind::kRows) {
    if (swiglu) return cudaErrorNotSupported;
    return LaunchKernel<T, kRows, Kind::kRows, false>(input, w, in, out, y, accumulate, stream);
  }
  if constexpr (kRows == 1) {
    if (input.kind == Kind::kRmsNorm) {
      return swiglu ? LaunchKernel<T, 1, Kind::kRmsNorm, true>(input, w, in, out, y, false, stream)
                    : LaunchKernel<T, 1, Kind::kRmsNorm, false>(input, w, in, out, y, accumulate,
                                                                 stream);
    }
    if (!swiglu) {
      return LaunchKernel<T, 1, Kind::kLayerNormGate, false>(input, w, in, out, y, accumulate,
                                                             stream);
    }
  }
  return cudaErrorNotSupported;
}

template <typename T>
cudaError_t LaunchForRows(int rows, const ProductInput& input, const void* w, int in, int out,
                          ProductOutput output, void* y, cudaStream_t stream) {
  switch (rows) {
    case 1: return LaunchForInput<T, 1>(input, w, in, out, output, y, stream);
    case 2: return LaunchForInput<T, 2>(input, w, in, out, output, y, stream);
    case 4: return LaunchForInput<T, 4>(input, w, in, out, output, y, stream);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace

bool SkinnyGemmFits(int rows, const ProductInput& input, int in, ElementType type,
                    const void* w) {
  if (rows < 1 || rows > kMaxSkinnyGemmRows || (rows & (rows - 1)) != 0 ||
      in % ElementsPerVector(type) != 0 || !Aligned16(w)) {
    return false;
  }
  if (input.kind == Kind::kRows) return Aligned16(input.rows);
  // A norm's input row is made inside the product for one row only: at two or four rows the
  // block's norm passes cost more than the kernel they save.
  if (rows != 1) return false;
  const bool gate_fits = input.kind != Kind::kLayerNormGate || input.gate == nullptr ||
                         (Aligned16(input.gate) && input.gate_ld % 4 == 0);
  return in % 4 == 0 && Aligned16(input.source) && Aligned16(input.weight) &&
         (input.kind != Kind::kLayerNormGate || Aligned16(input.bias)) && gate_fits &&
         ElementBytes(type) * in <= kMaxMadeInputBytes;
}

cudaError_t SkinnyGemm(int rows, const ProductInput& input, const void* w, int in, int out,
                       ElementType type, ProductOutput output, void* y, cudaStream_t stream) {
  if (!SkinnyGemmFits(rows, input, in, type, w)) return cudaErrorNotSupported;
  if (output == ProductOutput::kSwiGlu && out % 2 != 0) return cudaErrorInvalidValue;
  if (out == 0) return cudaSuccess;
  return type == ElementType::kBFloat16
             ? LaunchForRows<__nv_bfloat16>(rows, input, w, in, out, output, y, stream)
             : LaunchForRows<float>(rows, input, w, in, out, output, y, stream);
}

}  // namespace ttt::kernels::cuda
