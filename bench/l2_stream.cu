// How fast the SMs bring bytes into shared memory with bulk copies (cp.async.bulk, as products fed
// by TMA load their tiles), from L2 and from DRAM. A decode product at 256 rows is bound by this
// more than by DRAM: it reads each weight tile once per row tile and each activation tile once per
// column tile, mostly from L2. One block an SM; its lane 0 keeps `depth` chunks in flight into a
// ring in shared memory, 8 MB a block in all, over one of two patterns:
//   spread   each block its own part of a set of bytes (each byte read by one SM);
//   shared   every block the whole set, from its own starting point (an activation tile that
//            every column tile reads).
// Sets of 8 and 24 MB stay in L2 (its size is printed with each line); 2 GB comes from DRAM.
// Then the same from a 24 MB bf16 matrix [rows, 2,048] by tensor copies, as the products' TMA
// loads them (swizzled tiles of 64 columns): a box of `box_rows` rows of one slice of 64 columns,
// or of several slices at once through a map of three dimensions (SwizzledTileMap's `slices`).
// Prints one JSON line per (pattern, set, chunk, depth) and per (box, depth): GB/s in all and per
// SM, medians of 11 launches.
//   ttt-l2-stream
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cuda/ptx>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "kernels/cuda/grid_sync.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "server/util/percentile.h"

namespace {

using ttt::Median;

constexpr int kMaxDepth = 6, kMaxChunk = 32 * 1024;
using ttt::kernels::cuda::kSliceIn;
constexpr int kSliceBytes = kSliceIn * 2;  // A row of a slice: 64 bf16.
constexpr size_t kBytesPerBlock = size_t{8} << 20;

enum class Pattern { kSpread, kShared };

__global__ void __launch_bounds__(32, 1)
    Stream(const char* set, size_t set_bytes, Pattern pattern, int chunk_bytes, int depth) {
  extern __shared__ __align__(128) char ring[];
  __shared__ uint64_t full[kMaxDepth];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < depth; ++s) ::cuda::ptx::mbarrier_init(&full[s], 1);
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  // Parts start on 128-byte boundaries, as bulk copies need 16.
  const size_t part = pattern == Pattern::kSpread ? set_bytes / gridDim.x / 128 * 128 : set_bytes;
  const char* base = pattern == Pattern::kSpread ? set + blockIdx.x * part : set;
  const size_t chunks_in_part = part / chunk_bytes;
  const size_t first = pattern == Pattern::kShared ? blockIdx.x * 7 : 0;  // Not in lockstep.
  auto wait_for = [&](int chunk) {
    ttt::kernels::cuda::WaitForPhase(&full[chunk % depth], (chunk / depth) & 1);
  };
  const int chunks = static_cast<int>(kBytesPerBlock / chunk_bytes);
  for (int chunk = 0; chunk < chunks; ++chunk) {
    if (chunk >= depth) wait_for(chunk - depth);
    uint64_t* slot = &full[chunk % depth];
    ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                           ::cuda::ptx::space_shared, slot, chunk_bytes);
    const size_t offset = (first + chunk) % chunks_in_part * chunk_bytes;
    ::cuda::ptx::cp_async_bulk(::cuda::ptx::space_cluster, ::cuda::ptx::space_global,
                               ring + chunk % depth * kMaxChunk, base + offset, chunk_bytes, slot);
  }
  for (int c = max(0, chunks - depth); c < chunks; ++c) wait_for(c);
}

// Tensor copies of boxes of `box_rows` × kSliceIn × `slices` bf16 (8 MB a block), each block
// walking the matrix's rows from its own row and its slices in turn.
__global__ void __launch_bounds__(32, 1)
    StreamTiles(const __grid_constant__ CUtensorMap map, int rows, int slice_count, int box_rows,
                int slices, int depth) {
  extern __shared__ char ring_base[];
  __shared__ uint64_t full[kMaxDepth];
  if (threadIdx.x != 0) return;
  // Swizzled tiles start on 1,024-byte boundaries.
  char* ring =
      reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(ring_base) + 1023) & ~uintptr_t{1023});
  for (int s = 0; s < depth; ++s) ::cuda::ptx::mbarrier_init(&full[s], 1);
  ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  const int box_bytes = box_rows * kSliceBytes * slices;
  auto wait_for = [&](int chunk) {
    ttt::kernels::cuda::WaitForPhase(&full[chunk % depth], (chunk / depth) & 1);
  };
  const int chunks = static_cast<int>(kBytesPerBlock / box_bytes);
  const int row_starts = rows / box_rows, slice_starts = slice_count / slices;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    if (chunk >= depth) wait_for(chunk - depth);
    uint64_t* slot = &full[chunk % depth];
    ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                           ::cuda::ptx::space_shared, slot, box_bytes);
    const int row = (blockIdx.x * 7 + chunk / slice_starts) % row_starts * box_rows;
    const int slice = chunk % slice_starts * slices;
    char* to = ring + chunk % depth * kMaxChunk;
    if (slices == 1) {
      const int32_t at[2] = {slice * kSliceIn, row};
      ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, to,
                                        &map, at, slot);
    } else {
      const int32_t at[3] = {0, row, slice};
      ::cuda::ptx::cp_async_bulk_tensor(::cuda::ptx::space_cluster, ::cuda::ptx::space_global, to,
                                        &map, at, slot);
    }
  }
  for (int c = max(0, chunks - depth); c < chunks; ++c) wait_for(c);
}

// Times `launch` 12 times; the median of the last 11 (the first warms up L2).
template <typename Launch>
float MedianMs(EventTimer& timer, Launch&& launch) {
  std::vector<float> times;
  for (int run = 0; run < 12; ++run) {
    const float ms = timer.Ms([&] {
      launch();
      CHECK_CUDA(cudaGetLastError());
    });
    if (run > 0) times.push_back(ms);
  }
  return Median(times);
}

}  // namespace

int main() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t ring_bytes = kMaxDepth * kMaxChunk;
  CHECK_CUDA(cudaFuncSetAttribute(Stream, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_bytes));
  const size_t largest = size_t{2} << 30;
  char* buffer;
  CHECK_CUDA(cudaMalloc(&buffer, largest));
  CHECK_CUDA(cudaMemset(buffer, 1, largest));
  EventTimer timer;
  for (const Pattern pattern : {Pattern::kSpread, Pattern::kShared}) {
    for (const size_t set : {size_t{8} << 20, size_t{24} << 20, largest}) {
      if (pattern == Pattern::kShared && set == largest) continue;  // Each SM 8 MB of it: spread.
      for (const int chunk : {16 * 1024, 32 * 1024}) {
        for (const int depth : {2, 4, 6}) {
          const float ms = MedianMs(
              timer, [&] { Stream<<<sms, 32, ring_bytes>>>(buffer, set, pattern, chunk, depth); });
          const double gb_per_s = 1e-6 * static_cast<double>(kBytesPerBlock) * sms / ms;
          std::printf(
              "{\"gpu\":\"%s\",\"l2_bytes\":%d,\"pattern\":\"%s\",\"set_bytes\":%zu,"
              "\"chunk_bytes\":%d,\"chunks_in_flight\":%d,\"gb_per_s\":%.0f,"
              "\"gb_per_s_per_sm\":%.1f}\n",
              prop.name, prop.l2CacheSize, pattern == Pattern::kSpread ? "spread" : "shared", set,
              chunk, depth, gb_per_s, gb_per_s / sms);
        }
      }
    }
  }
  // Tensor copies from a matrix that stays in L2.
  constexpr int kIn = 2048;
  const int rows = (24 << 20) / (2 * kIn);
  const auto* matrix = reinterpret_cast<const __nv_bfloat16*>(buffer);
  CHECK_CUDA(cudaFuncSetAttribute(StreamTiles, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  ring_bytes + 1024));
  const int boxes[][2] = {{64, 1}, {128, 1}, {256, 1}, {64, 2}, {64, 4}, {128, 2}, {32, 8}};
  for (const auto& box : boxes) {
    const int box_rows = box[0], slices = box[1];
    CUtensorMap map;
    const cudaError_t made =
        ttt::kernels::cuda::SwizzledTileMap(matrix, rows, kIn, box_rows, slices, &map);
    if (made != cudaSuccess) {
      std::printf("{\"box_rows\":%d,\"slices\":%d,\"error\":\"%s\"}\n", box_rows, slices,
                  cudaGetErrorString(made));
      continue;
    }
    for (const int depth : {2, 4, 6}) {
      const float ms = MedianMs(timer, [&] {
        StreamTiles<<<sms, 32, ring_bytes + 1024>>>(map, rows, kIn / kSliceIn, box_rows, slices,
                                                    depth);
      });
      const double gb_per_s = 1e-6 * static_cast<double>(kBytesPerBlock) * sms / ms;
      std::printf(
          "{\"gpu\":\"%s\",\"copy\":\"tensor\",\"box_rows\":%d,\"slices\":%d,"
          "\"chunk_bytes\":%d,\"chunks_in_flight\":%d,\"gb_per_s\":%.0f,"
          "\"gb_per_s_per_sm\":%.1f}\n",
          prop.name, box_rows, slices, box_rows * kSliceBytes * slices, depth, gb_per_s,
          gb_per_s / sms);
    }
  }
  CHECK_CUDA(cudaFree(buffer));
  return 0;
}
