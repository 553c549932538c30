// Hopper's warpgroup products (wgmma) on bf16 tiles that TMA brings into shared memory, for the
// kernels built for sm_90a (kernels/cuda/tensor_core_products.cu, bench/decode_gemm.cu).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cuda/ptx>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grid_sync.cuh"

namespace ttt::kernels::cuda {

// K is taken in slices of 64 bf16: one 128-byte row of a swizzled tile.
inline constexpr int kSliceIn = 64;

// y (64 × N, float32, in wgmma's accumulator layout) += a (64 × 16) · b (N × 16)ᵀ, both read
// from shared memory through their descriptors. Thread t holds, for each group j of 8 outputs,
// d[4j .. 4j + 3]: outputs 8j + 2·(t % 4) + {0, 1} of rows 16·(t / 32) + (t % 32) / 4 and 8 below.
template <int kN>
__device__ void Wgmma(float* d, uint64_t a, uint64_t b);

template <>
__device__ __forceinline__ void Wgmma<8>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, "
      "0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b));
}

template <>
__device__ __forceinline__ void Wgmma<16>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7])
      : "l"(a), "l"(b));
}

template <>
__device__ __forceinline__ void Wgmma<32>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
      "}, %16, %17, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b));
}

template <>
__device__ __forceinline__ void Wgmma<64>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b));
}

template <>
__device__ __forceinline__ void Wgmma<128>(float* d, uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "l"(a), "l"(b));
}

// A wgmma descriptor of a tile of rows of 64 bf16 (128 bytes) in shared memory, swizzled as TMA's
// SWIZZLE_128B writes it: groups of 8 rows 1,024 bytes apart. Computed once a kernel: within a
// loop, its cvta and the stage arithmetic before it delayed each slice's wgmmas (bench/README.md
// v42).
__device__ __forceinline__ uint64_t SwizzledTile(const __nv_bfloat16* tile) {
  const uint64_t address = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  return ((address & 0x3FFFF) >> 4) | (uint64_t{16 >> 4} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// The descriptor of the tile `bytes` (a multiple of 16) past the one `tile` describes. Its
// address field counts 16-byte units in 14 bits, which hold every shared-memory address.
__device__ __forceinline__ uint64_t Advance(uint64_t tile, uint32_t bytes) {
  return tile + (bytes >> 4);
}

// A 64 × N step as wgmmas of 128, 64, 32, 16 and 8 outputs: their sums line up in d as one
// wgmma of N would hold them; `w` describes the first of N rows of a swizzled slice.
template <int kN>
__device__ __forceinline__ void WgmmaOfWidth(float* d, uint64_t a, uint64_t w) {
  constexpr int kPart = kN >= 128 ? 128 : kN >= 64 ? 64 : kN >= 32 ? 32 : kN >= 16 ? 16 : 8;
  Wgmma<kPart>(d, a, w);
  if constexpr (kN > kPart) {
    WgmmaOfWidth<kN - kPart>(d + kPart / 2, a,
                             Advance(w, kPart * kSliceIn * sizeof(__nv_bfloat16)));
  }
}

// A consumer warpgroup's pass over K: d (64 × kN) += the slices first, first + step, … below
// `slices`, slice t waited for in stage t % stages (whose `full` barrier completes a phase each
// time the stage is filled), where x's tile starts stage_bytes_x · stage past x_tiles and w's
// stage_bytes_w · stage past w_tiles. One slice's wgmmas stay in flight while the next's are
// issued; release(stage) is called once a stage's wgmmas are done with it, and every one is done
// when this returns. Stage, phase and descriptors are kept as the loop goes: derived per slice (a
// division by `stages`, a cvta), they delayed each slice's wgmmas (bench/README.md v42).
template <int kN, typename Release>
__device__ __forceinline__ void MultiplySlices(float* d, uint64_t* full, int stages,
                                               const __nv_bfloat16* x_tiles, uint32_t stage_bytes_x,
                                               const __nv_bfloat16* w_tiles, uint32_t stage_bytes_w,
                                               int first, int step, int slices, Release release) {
  const uint64_t x_first = SwizzledTile(x_tiles), w_first = SwizzledTile(w_tiles);
  int previous = -1;         // The stage of the slice still in flight.
  int s = first, phase = 0;  // first < stages.
  for (int t = first; t < slices; t += step) {
    WaitForPhase(&full[s], phase);
    const uint64_t x_slice = Advance(x_first, s * stage_bytes_x);
    const uint64_t w_slice = Advance(w_first, s * stage_bytes_w);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int k = 0; k < kSliceIn; k += 16) {
      const uint32_t bytes = k * sizeof(__nv_bfloat16);
      WgmmaOfWidth<kN>(d, Advance(x_slice, bytes), Advance(w_slice, bytes));
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
    if (previous >= 0) release(previous);
    previous = s;
    s += step;
    if (s >= stages) {
      s -= stages;
      phase ^= 1;
    }
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  if (previous >= 0) release(previous);
#pragma unroll
  for (int i = 0; i < kN / 2; ++i) {
    asm volatile("" : "+f"(d[i])::"memory");  // Final only now: no read may move above the wait.
  }
}

// A producer's pass over K: slice t of w (load_w(t)) and of x (load_x(t)) into stage t % stages,
// whose `full` barrier then expects stage_bytes; a stage is refilled once its `empty` barrier has
// completed the phase of its previous slice. The first `stages` slices of w are asked for before
// the wait for the previous kernel: weights are never a kernel's output, so they stream in beside
// the kernel that makes x.
template <typename LoadW, typename LoadX>
__device__ __forceinline__ void ProduceSlices(uint64_t* full, uint64_t* empty, int stages,
                                              int slices, uint32_t stage_bytes, LoadW load_w,
                                              LoadX load_x) {
  namespace ptx = ::cuda::ptx;
  const int early = min(slices, stages);
  for (int t = 0; t < early; ++t) {
    ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[t],
                                   stage_bytes);
    load_w(t);
  }
  WaitForPreviousKernel();
  for (int t = 0; t < slices; ++t) {
    const int s = t % stages;
    if (t >= stages) {
      WaitForPhase(&empty[s], (t / stages + 1) % 2);
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[s],
                                     stage_bytes);
      load_w(t);
    }
    load_x(t);
  }
}

// Releases a stage in the block of rank `cta` of this block's cluster. The release is the
// block's own (.cta, the default), as the stage's reads were: a cluster-scope release is a
// fence that waits for every memory operation of the warp.
__device__ __forceinline__ void ArriveInCluster(uint64_t* barrier, uint32_t cta) {
  const auto local = static_cast<uint32_t>(__cvta_generic_to_shared(barrier));
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}" ::"r"(local),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ void SyncCluster() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::
                   : "memory");
}

// A TMA map of a row-major bf16 matrix [rows, in], read in boxes of box_rows × kSliceIn swizzled
// as SwizzledTile's descriptors expect; reads past its rows or columns give zeros
// (cudaErrorNotSupported where the driver has no tensor maps). With `slices` > 1 (`in` a multiple
// of kSliceIn) a box is that many slices of K side by side, landing as as many such tiles one
// after another, in one copy (ttt-l2-stream times both; slices past K are zeros). Host code, in
// tensor_core_products.cu.
cudaError_t SwizzledTileMap(const __nv_bfloat16* matrix, int rows, int in, int box_rows, int slices,
                            CUtensorMap* map);

}  // namespace ttt::kernels::cuda
