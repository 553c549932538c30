// A decode product whose tiles hold all of a step's rows (up to 256), with K split among the
// blocks of a cluster that add their sums through distributed shared memory; sm_90a (wgmma, TMA).
//
// Why: at 256 rows a product's 64-row tiles re-read x from L2 once per column block, so a 64 × 64
// tile of 1b's o_proj (K = 2,048) brings 512 KB into its SM, and the 1b products are bound by
// that traffic rather than by their wgmmas (bench/README.md v41, v42, v62). A 256 × 128 tile over
// an eighth of K brings 192 KB, and every weight crosses from DRAM once. The blocks that hold one
// column tile's shares of K form a cluster; each writes its partial tile into its own shared
// memory, and each then sums one stripe of the rows over the cluster's partial tiles in split
// order (a result that does not depend on timing, unlike atomic adds) and stores it or adds it
// into y. With kPairs = 2, two column tiles in the cluster also share x's slices: each block
// brings half of every slice into both (TMA multicast).
//
// A block: four consumer warpgroups, each taking 64 rows of every slice (MultiplySlices), and a
// producer warp that keeps `stages` slices of x and w in flight, asking for its first slices of w
// before the previous kernel has ended (weights are never a kernel's output).
//
// Timed by ttt-decode-gemm only: at the presets' products it is slower than cuBLASLt's kernels
// (bench/README.md v63; v64 says where its time goes), so the engine does not run it.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cuda/ptx>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grid_sync.cuh"
#include "kernels/cuda/wgmma.cuh"

namespace ttt::bench {

using kernels::cuda::ArriveInCluster;
using kernels::cuda::kSliceIn;
using kernels::cuda::kWarp;
using kernels::cuda::MultiplySlices;
using kernels::cuda::ProduceSlices;
using kernels::cuda::SyncCluster;
using kernels::cuda::WaitForPreviousKernel;

inline constexpr int kClusterRows = 256, kClusterConsumers = 4;
inline constexpr int kClusterThreads = 128 * kClusterConsumers + 32;
inline constexpr int kClusterMaxStages = 32;

// Four floats at `local`'s offset in the shared memory of block `cta` of this cluster.
__device__ __forceinline__ float4 LoadFromCluster(const float* local, uint32_t cta) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  float4 v;
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %4, %5;\n"
      "ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [remote];\n"
      "}"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "r"(address), "r"(cta)
      : "memory");
  return v;
}

// Where the product goes: y [rows, out], rows ld floats apart, stored or (add) added into.
struct ClusterSplitOutput {
  float* y;
  int64_t ld;
  int rows, out;
  bool add;
};

// The dynamic shared memory a block takes: the stages, or its partial tile where that is larger,
// and room to align them to 1,024 bytes.
template <int kN>
constexpr size_t ClusterSplitSharedBytes(int stages) {
  const size_t stage_bytes = sizeof(__nv_bfloat16) * (kClusterRows + kN) * kSliceIn;
  const size_t partial_bytes = sizeof(float) * kClusterRows * (kN + 8);
  return (stages * stage_bytes > partial_bytes ? stages * stage_bytes : partial_bytes) + 1024;
}

// Grid (column tiles rounded up to kPairs, 1, splits), clusters (kPairs, 1, splits): block
// (x, 0, z) multiplies column tile x over slices [z · tiles_per_split, …) of K. x_map's boxes are
// kClusterRows / kPairs rows of a slice, w_map's kN rows (SwizzledTileMap).
template <int kN, int kPairs>
__global__ void __launch_bounds__(kClusterThreads)
    ClusterSplitKernel(const __grid_constant__ CUtensorMap x_map,
                       const __grid_constant__ CUtensorMap w_map, int in, int stages,
                       int tiles_per_split, ClusterSplitOutput o) {
  static_assert(kN % 8 == 0 && kN <= 256 && (kPairs == 1 || kPairs == 2));
  using bf16 = __nv_bfloat16;
  namespace ptx = ::cuda::ptx;
  constexpr int kGroupRows = kClusterRows / kClusterConsumers;
  constexpr int kXElements = kClusterRows * kSliceIn, kWElements = kN * kSliceIn;
  constexpr int kXPartRows = kClusterRows / kPairs;  // Of each slice of x, what one block brings.
  constexpr uint32_t kStageBytes = sizeof(bf16) * (kXElements + kWElements);
  constexpr int kPartialStride = kN + 8;  // Floats a row: float2 stores of 8 rows miss each other.
  extern __shared__ unsigned char shared[];
  __shared__ uint64_t full[kClusterMaxStages], empty[kClusterMaxStages];
  bf16* x_tiles =
      reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(shared) + 1023) & ~uintptr_t{1023});
  bf16* w_tiles = x_tiles + stages * kXElements;
  const int out0 = blockIdx.x * kN;
  const int first_tile = blockIdx.z * tiles_per_split;
  const int tiles = min((in + kSliceIn - 1) / kSliceIn, first_tile + tiles_per_split) - first_tile;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int splits = gridDim.z;               // The cluster holds one block of each split.
  const uint32_t pair = blockIdx.x % kPairs;  // This block's rank is pair + kPairs · blockIdx.z.
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      // Lane 0 of each consumer warp, in both blocks of a pair.
      ptx::mbarrier_init(&empty[s], 4 * kClusterConsumers * kPairs);
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  SyncCluster();  // Every block's barriers are ready before any copy or arrival reaches them.

  const bool producer = warp == 4 * kClusterConsumers;
  if (producer && lane == 0) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(&w_map) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(&x_map) : "memory");
    auto load_w = [&](int t) {
      const int32_t at[2] = {(first_tile + t) * kSliceIn, out0};
      ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global,
                                w_tiles + (t % stages) * kWElements, &w_map, at, &full[t % stages]);
    };
    auto load_x = [&](int t) {
      const int32_t at[2] = {(first_tile + t) * kSliceIn, static_cast<int>(pair) * kXPartRows};
      bf16* part = x_tiles + (t % stages) * kXElements + pair * kXPartRows * kSliceIn;
      if constexpr (kPairs > 1) {
        const auto both = static_cast<uint16_t>(0b11u << (kPairs * blockIdx.z));
        ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, part, &x_map, at,
                                  &full[t % stages], both);
      } else {
        ptx::cp_async_bulk_tensor(ptx::space_cluster, ptx::space_global, part, &x_map, at,
                                  &full[t % stages]);
      }
    };
    ProduceSlices(full, empty, stages, tiles, kStageBytes, load_w, load_x);
  }

  // The block's partial tile, [kClusterRows][kPartialStride] floats over the stages once every
  // slice is used.
  float* partial = reinterpret_cast<float*>(x_tiles);
  if (!producer) {
    // y is read and written only after the previous kernel has ended.
    WaitForPreviousKernel();
    const int consumer = warp / 4;
    auto release = [&](int s) {
      if (lane != 0) return;
      if constexpr (kPairs > 1) {
        for (uint32_t p = 0; p < kPairs; ++p) ArriveInCluster(&empty[s], p + kPairs * blockIdx.z);
      } else {
        ptx::mbarrier_arrive(&empty[s]);
      }
    };
    float d[kN / 2] = {};
    MultiplySlices<kN>(d, full, stages, x_tiles + consumer * kGroupRows * kSliceIn,
                       kXElements * sizeof(bf16), w_tiles, kWElements * sizeof(bf16), 0, 1, tiles,
                       release);
    // Every copy into this block's stages, its partner's included, has landed (each slice was
    // waited for), so once its own consumers are done the stages are free.
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kClusterConsumers) : "memory");
    const int top = consumer * kGroupRows + 16 * (warp % 4) + lane / 4;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      const int column = 8 * j + 2 * (lane % 4);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        *reinterpret_cast<float2*>(partial + (top + 8 * half) * kPartialStride + column) =
            make_float2(d[4 * j + 2 * half], d[4 * j + 2 * half + 1]);
      }
    }
  }
  __syncwarp();   // The producer's lanes meet again before the cluster's barrier.
  SyncCluster();  // Every block's partial tile is written.

  if (!producer) {
    // This block's rows: the z-th of `splits` stripes, the partial tiles of its column tile's
    // blocks summed in split order, then stored or added into y.
    const int stripe_rows = kClusterRows / splits;
    constexpr int kQuads = kN / 4;  // Four-float pieces of a row.
    for (int piece = threadIdx.x; piece < stripe_rows * kQuads; piece += 128 * kClusterConsumers) {
      const int row = blockIdx.z * stripe_rows + piece / kQuads, column = piece % kQuads * 4;
      if (row >= o.rows || out0 + column >= o.out) continue;
      const float* local = partial + row * kPartialStride + column;
      float4 sum = LoadFromCluster(local, pair);
      for (int split = 1; split < splits; ++split) {
        const float4 v = LoadFromCluster(local, pair + kPairs * split);
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      }
      float4* target = reinterpret_cast<float4*>(o.y + row * o.ld + out0 + column);
      if (o.add) {
        const float4 earlier = *target;
        sum.x += earlier.x;
        sum.y += earlier.y;
        sum.z += earlier.z;
        sum.w += earlier.w;
      }
      *target = sum;
    }
  }
  SyncCluster();  // No block leaves while another reads its partial tile.
}

}  // namespace ttt::bench
