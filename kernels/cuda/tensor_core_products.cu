// A decode step's dense products on Hopper's tensor cores (see TensorCoreProduct and
// FeedForwardEntry in cuda_ops.h): wgmma products fed by TMA. The TTT layer's input projection
// stores its sums; the feed-forward's entry, o_proj and gate_up, has epilogues that do the row
// work that otherwise takes two kernels of its own (the RMSNorm before gate_up and the SwiGLU
// after it).
//
// A block computes a 64 × kN tile of outputs. One producer warp keeps up to `stages` 64-wide
// slices of K of x and w in flight into shared memory (TMA, 128-byte swizzled, as wgmma's
// descriptors read them); kConsumers warpgroups take the slices in turn, each keeping one slice's
// wgmmas in flight while it issues the next, and add their sums at the end. Tiles are sized for
// 256-row decode steps (bench/README.md v14, v27: kProjectionTile and the others below).
//
// wgmma is an sm_90a instruction: this file is built for that target alone (kernels/CMakeLists.txt)
// and TensorCoreProductsAvailable() tells whether the device runs it.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cuda/ptx>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grid_sync.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace ttt::kernels::cuda {
namespace {

namespace ptx = ::cuda::ptx;
using bf16 = __nv_bfloat16;

// kMaxStages: slices in flight at most (the size of the stages' barrier arrays).
constexpr int kTileRows = 64, kMaxStages = 16, kConsumers = 2;
constexpr int kThreads = 128 * kConsumers + 32;
// Output tiles, sized so that a product's blocks leave about a quarter of the SMs or more to the
// kernel after it, whose blocks start there while the product runs (bench/README.md v27):
// - o_proj's narrow: its D outputs are few (125m: 24 × 4 blocks at 256 rows), and gate_up's
//   blocks fetch their first slices of w beside them;
// - gate_up's wide (2I outputs; 125m: 32 × 4);
// - the input projection's (kStore): 125m's 2,368 outputs in 25 × 4 blocks at 256 rows, 33 × 2
//   at 128, the TTT kernel after it streaming its state beside them.
constexpr int kProjectionTile = 32, kGateUpTile = 128;
constexpr int kStoreTile = 96, kStoreTileFewRows = 72;  // The latter up to 128 rows.
constexpr size_t kSharedLimit = 227 * 1024 - 1024;      // Less the room to align the stages.

// The consumers' named barriers (0 is __syncthreads'): all of them, then consumer 0's alone.
constexpr int kAllConsumersBarrier = 1, kFirstConsumerBarrier = 2;

enum class Epilogue { kStore, kOutputProjection, kGateUpSwiGlu };

// What the epilogues write and read besides the product (see TensorCoreProduct and
// FeedForwardEntry).
struct EpilogueArgs {
  int rows;  // The step's rows: the tiles' rows past them are TMA's zeros and not written.
  int out;   // The product's outputs.
  int D;
  // kStore: y [rows, out], rows ld floats apart.
  float* y;
  int64_t ld;
  // kOutputProjection.
  float* h;
  const float* norm_weight;
  bf16* normed;
  // Both: [square_tiles, row_stride], a row's sum of squares of h over a tile's columns.
  float* row_squares;
  int square_tiles;
  int row_stride;
  // kGateUpSwiGlu.
  float eps;
  bf16* activation;
};

// A plain product's epilogue: y = the sums, a thread's two adjacent outputs in one store.
template <int kN>
__device__ __forceinline__ void StoreSums(const float* d, int top, int out0,
                                          const EpilogueArgs& e) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int column = out0 + 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = top + 8 * half;
      if (column < e.out && row < e.rows) {
        *reinterpret_cast<float2*>(e.y + row * e.ld + column) =
            make_float2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
      }
    }
  }
}

// o_proj's epilogue reads h where this thread's sums go (as wgmma's accumulator layout places
// them: for each group j of 8 outputs and each half, rows `top` and `top` + 8) and those
// columns' norm weights, all before the product, so that the epilogue waits on no load. (Loaded
// in the epilogue, each group's weights would wait for the stores before them, which may alias.)
struct ProjectionRows {
  static constexpr int kGroups = kProjectionTile / 8;
  float2 h[kGroups][2];
  float2 gain[kGroups];
};

__device__ __forceinline__ bool InOutputProjection(int column, int row, const EpilogueArgs& e) {
  return column < e.out && row < e.rows;
}

__device__ __forceinline__ ProjectionRows LoadProjectionRows(int top, int out0,
                                                             const EpilogueArgs& e) {
  const int lane = threadIdx.x % kWarp;
  ProjectionRows rows;
#pragma unroll
  for (int j = 0; j < ProjectionRows::kGroups; ++j) {
    const int column = out0 + 8 * j + 2 * (lane % 4);
    rows.gain[j] = column < e.out ? *reinterpret_cast<const float2*>(e.norm_weight + column)
                                  : make_float2(0, 0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = top + 8 * half;
      rows.h[j][half] =
          InOutputProjection(column, row, e)
              ? *reinterpret_cast<const float2*>(e.h + static_cast<int64_t>(row) * e.D + column)
              : make_float2(0, 0);
    }
  }
  return rows;
}

// o_proj's epilogue: h += the sums; the norm's input h ⊙ norm_weight in bf16; each row's sum of
// squares of h over this tile's columns (the norm's 1/rms is taken from them in gate_up's).
__device__ __forceinline__ void WriteOutputProjection(const float* d, int top, int out0,
                                                      const ProjectionRows& before,
                                                      const EpilogueArgs& e) {
  const int lane = threadIdx.x % kWarp;
  float squares[2] = {0, 0};
#pragma unroll
  for (int j = 0; j < ProjectionRows::kGroups; ++j) {
    const int column = out0 + 8 * j + 2 * (lane % 4);
    const float2 gain = before.gain[j];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = top + 8 * half;
      if (!InOutputProjection(column, row, e)) continue;
      const int64_t at = static_cast<int64_t>(row) * e.D + column;
      const float2 h = make_float2(before.h[j][half].x + d[4 * j + 2 * half],
                                   before.h[j][half].y + d[4 * j + 2 * half + 1]);
      *reinterpret_cast<float2*>(e.h + at) = h;
      *reinterpret_cast<__nv_bfloat162*>(e.normed + at) =
          __floats2bfloat162_rn(h.x * gain.x, h.y * gain.y);
      squares[half] += h.x * h.x + h.y * h.y;
    }
  }
  // A row's columns lie in the four lanes of a quad.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    squares[half] += __shfl_xor_sync(0xffffffffu, squares[half], 1);
    squares[half] += __shfl_xor_sync(0xffffffffu, squares[half], 2);
    const int row = top + 8 * half;
    if (lane % 4 == 0 && row < e.rows) {
      e.row_squares[static_cast<int64_t>(blockIdx.x) * e.row_stride + row] = squares[half];
    }
  }
}

// gate_up's epilogue: the sums times the row's 1/rms, then silu(gate) · up of each (gate, up)
// output pair, staged in shared memory (`staged`, 64 × kGateUpTile / 2) and written 16 bytes a
// thread (from the sums' layout a row's 2-byte pieces would be 8 bytes apart).
__device__ __forceinline__ void WriteGateUpSwiGlu(const float* d, int top, int row0, int out0,
                                                  const float* inv_rms, bf16* staged,
                                                  const EpilogueArgs& e) {
  constexpr int kChannels = kGateUpTile / 2;
  const int lane = threadIdx.x % kWarp;
  const int local = top - row0;
  const float scale[2] = {inv_rms[local], inv_rms[local + 8]};
#pragma unroll
  for (int j = 0; j < kGateUpTile / 8; ++j) {
    const int channel = 4 * j + lane % 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      staged[(local + 8 * half) * kChannels + channel] = __float2bfloat16(
          Swish(scale[half] * d[4 * j + 2 * half], scale[half] * d[4 * j + 2 * half + 1]));
    }
  }
  asm volatile("bar.sync %0, 128;" ::"n"(kFirstConsumerBarrier) : "memory");
  const int width = e.out / 2, channel0 = out0 / 2;
  constexpr int kPieces = kChannels / 8;  // 16-byte pieces of a row.
  for (int piece = threadIdx.x; piece < kTileRows * kPieces; piece += 128) {
    const int r = piece / kPieces, c = piece % kPieces * 8;
    if (row0 + r >= e.rows || channel0 + c >= width) continue;
    *reinterpret_cast<uint4*>(e.activation + static_cast<int64_t>(row0 + r) * width + channel0 +
                              c) = *reinterpret_cast<const uint4*>(staged + r * kChannels + c);
  }
}

template <int kN, Epilogue kEpilogue>
__global__ void __launch_bounds__(kThreads)
    TensorCoreProductKernel(const __grid_constant__ CUtensorMap x_map,
                            const __grid_constant__ CUtensorMap w_map, int in, int stages,
                            EpilogueArgs e) {
  constexpr int kXElements = kTileRows * kSliceIn, kWElements = kN * kSliceIn;
  constexpr uint32_t kStageBytes = sizeof(bf16) * (kXElements + kWElements);
  extern __shared__ unsigned char shared[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float inv_rms[kTileRows];  // kGateUpSwiGlu: the tile's rows'.
  // Swizzled tiles start on 1,024-byte boundaries (the launch adds that much room).
  bf16* x_tiles =
      reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(shared) + 1023) & ~uintptr_t{1023});
  bf16* w_tiles = x_tiles + stages * kXElements;
  const int out0 = blockIdx.x * kN, row0 = blockIdx.y * kTileRows;
  const int tiles = (in + kSliceIn - 1) / kSliceIn;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], 4);  // Lane 0 of each warp of the slice's consumer.
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncthreads();

  if (warp == 4 * kConsumers) {  // The producer.
    if (lane != 0) return;
    asm volatile("prefetch.tensormap [%0];" ::"l"(&w_map) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(&x_map) : "memory");
    auto load = [&](const CUtensorMap* map, int t, bf16* tiles_base, int elements, int row) {
      const int32_t at[2] = {t * kSliceIn, row};
      ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global,
                                tiles_base + (t % stages) * elements, map, at, &full[t % stages]);
    };
    ProduceSlices(
        full, empty, stages, tiles, kStageBytes,
        [&](int t) { load(&w_map, t, w_tiles, kWElements, out0); },
        [&](int t) { load(&x_map, t, x_tiles, kXElements, row0); });
    return;
  }

  // h, the row sums of squares and the outputs are read and written only after the previous
  // kernel has ended.
  WaitForPreviousKernel();
  const int consumer = warp / 4;
  const int top = row0 + 16 * (warp % 4) + lane / 4;  // This thread's first row of sums.
  ProjectionRows before;
  if constexpr (kEpilogue == Epilogue::kOutputProjection) {
    if (consumer == 0) before = LoadProjectionRows(top, out0, e);
  } else if constexpr (kEpilogue == Epilogue::kGateUpSwiGlu) {
    // The rows' 1/rms, from o_proj's sums of squares, while the first slices arrive.
    if (threadIdx.x < kTileRows) {
      const int row = row0 + threadIdx.x;
      float squares = 0;
      if (row < e.rows) {
#pragma unroll 8
        for (int t = 0; t < e.square_tiles; ++t) {
          squares += e.row_squares[static_cast<int64_t>(t) * e.row_stride + row];
        }
      }
      inv_rms[threadIdx.x] = rsqrtf(squares / e.D + e.eps);
    }
  }
  float d[kN / 2] = {};
  MultiplySlices<kN>(d, full, stages, x_tiles, kXElements * sizeof(bf16), w_tiles,
                     kWElements * sizeof(bf16), consumer, kConsumers, tiles, [&](int stage) {
                       if (lane == 0) ptx::mbarrier_arrive(&empty[stage]);
                     });
  // The other consumers' sums come to the first through x's stages, once every slice is used.
  float* partial = reinterpret_cast<float*>(x_tiles);
  const int thread = threadIdx.x % 128;
  asm volatile("bar.sync %0, %1;" ::"n"(kAllConsumersBarrier), "n"(128 * kConsumers) : "memory");
  if (consumer > 0) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) partial[((consumer - 1) * kN / 2 + i) * 128 + thread] = d[i];
  }
  asm volatile("bar.sync %0, %1;" ::"n"(kAllConsumersBarrier), "n"(128 * kConsumers) : "memory");
  if (consumer > 0) return;
  for (int c = 1; c < kConsumers; ++c) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) d[i] += partial[((c - 1) * kN / 2 + i) * 128 + thread];
  }
  if constexpr (kEpilogue == Epilogue::kStore) {
    StoreSums<kN>(d, top, out0, e);
  } else if constexpr (kEpilogue == Epilogue::kOutputProjection) {
    WriteOutputProjection(d, top, out0, before, e);
  } else {
    WriteGateUpSwiGlu(d, top, row0, out0, inv_rms, w_tiles, e);
  }
}

// The slices a kernel of tile width kN keeps in flight for `in` inputs: all of K where it fits (up
// to kMaxStages), and enough for the other consumers' sums to pass through x's stages.
template <int kN>
int Stages(int in) {
  constexpr size_t kStageBytes = sizeof(bf16) * (kTileRows + kN) * kSliceIn;
  // The other consumers' sums pass through x's stages.
  constexpr size_t kPartialBytes = sizeof(float) * (kConsumers - 1) * kN / 2 * 128;
  const int tiles = (in + kSliceIn - 1) / kSliceIn;
  const int fit = static_cast<int>(kSharedLimit / kStageBytes);
  const int for_partials =
      static_cast<int>((kPartialBytes + sizeof(bf16) * kTileRows * kSliceIn - 1) /
                       (sizeof(bf16) * kTileRows * kSliceIn));
  return std::max(std::min({kMaxStages, tiles, fit}), for_partials);
}

// Its dynamic shared memory: the stages, and room to align them to 1,024 bytes.
template <int kN>
size_t SharedBytes(int stages) {
  return stages * sizeof(bf16) * (kTileRows + kN) * kSliceIn + 1024;
}

PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000,
                                         cudaEnableDefault, &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function);
  }();
  return encode;
}

template <int kN, Epilogue kEpilogue>
cudaError_t LaunchProduct(const bf16* x, int rows, int in, const bf16* w, int out,
                          const EpilogueArgs& e, cudaStream_t stream) {
  CUtensorMap x_map, w_map;
  if (cudaError_t error = SwizzledTileMap(x, rows, in, kTileRows, 1, &x_map);
      error != cudaSuccess) {
    return error;
  }
  if (cudaError_t error = SwizzledTileMap(w, out, in, kN, 1, &w_map); error != cudaSuccess)
    return error;
  const int stages = Stages<kN>(in);
  const dim3 grid((out + kN - 1) / kN, (rows + kTileRows - 1) / kTileRows);
  return Launch(TensorCoreProductKernel<kN, kEpilogue>, grid, kThreads, SharedBytes<kN>(stages),
                stream, x_map, w_map, in, stages, e);
}

// Lets the kernel have the shared memory it takes at any K.
template <int kN, Epilogue kEpilogue>
cudaError_t AllowSharedMemory() {
  constexpr int kWidestK = kMaxStages * kSliceIn;
  return cudaFuncSetAttribute(TensorCoreProductKernel<kN, kEpilogue>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(SharedBytes<kN>(Stages<kN>(kWidestK))));
}

}  // namespace

cudaError_t SwizzledTileMap(const bf16* matrix, int rows, int in, int box_rows, int slices,
                            CUtensorMap* map) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = TensorMapEncoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  if (slices > 1 && in % kSliceIn != 0) return cudaErrorInvalidValue;
  // Several slices a box: the matrix as [in / kSliceIn slices][rows][kSliceIn], so that a box
  // lands as `slices` swizzled tiles one after another.
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(slices > 1 ? kSliceIn : in),
                              static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(in / kSliceIn)};
  const cuuint64_t strides[2] = {sizeof(bf16) * static_cast<cuuint64_t>(in),
                                 sizeof(bf16) * kSliceIn};
  const cuuint32_t box[3] = {kSliceIn, static_cast<cuuint32_t>(box_rows),
                             static_cast<cuuint32_t>(slices)},
                   unit[3] = {1, 1, 1};
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, slices > 1 ? 3 : 2, const_cast<bf16*>(matrix),
             dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

bool TensorCoreProductsAvailable(int D, int I) {
  if (D % 8 != 0 || I % 8 != 0 || TensorMapEncoder() == nullptr) return false;
  // Loads the sm_90a image: an error on any other GPU.
  if (AllowSharedMemory<kStoreTile, Epilogue::kStore>() != cudaSuccess ||
      AllowSharedMemory<kStoreTileFewRows, Epilogue::kStore>() != cudaSuccess ||
      AllowSharedMemory<kProjectionTile, Epilogue::kOutputProjection>() != cudaSuccess ||
      AllowSharedMemory<kGateUpTile, Epilogue::kGateUpSwiGlu>() != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

cudaError_t TensorCoreProduct(const void* x, int rows, int in, const void* w, int out, float* y,
                              int64_t ld, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (in % 8 != 0 || out % 8 != 0 || ld < out || ld % 2 != 0) return cudaErrorInvalidValue;
  const EpilogueArgs e{.rows = rows, .out = out, .y = y, .ld = ld};
  const auto* x_rows = static_cast<const bf16*>(x);
  const auto* weights = static_cast<const bf16*>(w);
  return rows <= 2 * kTileRows ? LaunchProduct<kStoreTileFewRows, Epilogue::kStore>(
                                     x_rows, rows, in, weights, out, e, stream)
                               : LaunchProduct<kStoreTile, Epilogue::kStore>(
                                     x_rows, rows, in, weights, out, e, stream);
}

int FeedForwardEntry::SquareTiles(int D) { return (D + kProjectionTile - 1) / kProjectionTile; }

cudaError_t FeedForwardEntry::Run(int rows, cudaStream_t stream) const {
  if (rows == 0) return cudaSuccess;
  if (rows > row_stride) return cudaErrorInvalidValue;
  const auto* gated_rows = static_cast<const bf16*>(post_norm_rows);
  EpilogueArgs e{.rows = rows,
                 .out = D,
                 .D = D,
                 .h = h,
                 .norm_weight = ffn_norm_weight,
                 .normed = static_cast<bf16*>(normed),
                 .row_squares = row_squares,
                 .square_tiles = SquareTiles(D),
                 .row_stride = row_stride,
                 .eps = eps,
                 .activation = static_cast<bf16*>(activation)};
  if (cudaError_t error = LaunchProduct<kProjectionTile, Epilogue::kOutputProjection>(
          gated_rows, rows, D, static_cast<const bf16*>(o_proj), D, e, stream);
      error != cudaSuccess) {
    return error;
  }
  e.out = 2 * I;
  return LaunchProduct<kGateUpTile, Epilogue::kGateUpSwiGlu>(static_cast<const bf16*>(normed), rows,
                                                             D, static_cast<const bf16*>(gate_up),
                                                             2 * I, e, stream);
}

}  // namespace ttt::kernels::cuda
