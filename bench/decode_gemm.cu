// What a tensor-core kernel of our own reaches on a decode step's dense products at 256 rows,
// against the cuBLASLt kernel the engine runs (its heuristic's first: see server/engine/
// cuda_gemm.h). Each product is y [rows, out] (+)= x [rows, in] · wᵀ, bf16 in, float32 out, for
// the 125m and 1b presets' shapes:
//   cublaslt       the heuristic's first kernel, planned as CudaGemm plans it.
//   wgmma_RxN_Sstages_Cconsumers[_cluster2]  ours with Hopper's instructions: R × N output
//                  tiles of wgmma fed by TMA through S stages; R = 64 with C consumer
//                  warpgroups taking K's slices in turn, or R = 128 with one on each 64 rows;
//                  with _cluster2, pairs of row tiles sharing w's slices (TMA multicast). N from
//                  24 to 256, where the tiles number an eighth of the SMs to twice them (see
//                  WgmmaKernel).
//   …_split_k      the same where the tiles are fewer than the SMs, with K split among blocks
//                  that add their sums into y atomically (y zeroed first when the product
//                  stores: that memset is timed with it).
//   cluster_split_256xN_Sstages_kK[_x_pairs]_R_of_C_clusters_resident  tiles of all 256 rows
//                  by N outputs, K split K ways among a cluster's blocks, which sum their
//                  partial tiles through distributed shared memory (ClusterSplitKernel); with
//                  _x_pairs, two column tiles also share x's slices; R of the grid's C clusters
//                  fit on the GPU at once.
//   …_chained      the time the product adds after a row kernel (see BusyKernel).
//   cublaslt_then_swiglu, …_swiglu  gate_up as the engine runs it (cuBLASLt's product, then the
//                  engine's SwiGLU kernel writing the bf16 activation), and ours writing that
//                  activation from its epilogue (checked against cuBLASLt's sums through SwiGLU).
// L2 is flushed before every timed run: in a step each product's weights were last read a
// whole step ago. With TTT_GEMM_L2=warm it is not, so each run finds the weights and x where the
// run before left them, as it would if they had been prefetched into L2. An empty kernel timed
// the same way comes first (the timing's own cost).
// TTT_GEMM_ABLATION=delivery or =compute times our kernels' copies alone or wgmmas alone.
// Prints one JSON line per (preset, product, variant): the median of 20 runs, TFLOP/s, and for
// ours the largest difference from cuBLASLt's result over its largest value.
//   ttt-decode-gemm [PRESET/PRODUCT]      (e.g. 125m/gate_up: that product alone)
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda/ptx>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/cluster_split_product.cuh"
#include "bench/cublaslt_plan.h"
#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "bench/product_inputs.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/grid_sync.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "server/util/percentile.h"

namespace {

using bf16 = __nv_bfloat16;
using ttt::Median;
using ttt::bench::ClusterSplitKernel;
using ttt::bench::ClusterSplitOutput;
using ttt::bench::ClusterSplitSharedBytes;
using ttt::bench::kClusterMaxStages;
using ttt::bench::kClusterRows;
using ttt::bench::kClusterThreads;
using ttt::kernels::cuda::ArriveInCluster;
using ttt::kernels::cuda::kSliceIn;
using ttt::kernels::cuda::Launch;
using ttt::kernels::cuda::MultiplySlices;
using ttt::kernels::cuda::ProduceSlices;
using ttt::kernels::cuda::Swish;
using ttt::kernels::cuda::SyncCluster;
using ttt::kernels::cuda::WaitForPhase;
using ttt::kernels::cuda::WaitForPreviousKernel;

// Where the time goes (TTT_GEMM_ABLATION=delivery or compute): the producer's copies with no
// wgmma, or the wgmmas on whatever the stages hold, each stage marked full with no copy (results
// wrong). The consumers' loop that multiplies is one and the same in every form: where a kernel
// had a loop of its own for each, ptxas serialized every wgmma (C7515: moves define the
// accumulators between the loops), and all of v41's figures for ours were so measured
// (bench/README.md v42).
enum class Ablation { kNone, kDeliveryOnly, kComputeOnly };

// How a block writes its sums: y = sums, y += sums (the only writer), atomically added, or as
// the feed-forward's activation: outputs 2c and 2c + 1 are gate and up of channel c (the engine
// lays gate_up's weights out so), and y is bf16 [rows, out / 2] with silu(gate) · up.
enum class Write { kStore, kAdd, kAtomicAdd, kSwiGlu };

// Two adjacent sums, y[0] and y[1] (8-byte aligned), stored or atomically added.
__device__ __forceinline__ void WriteSums(float* y, float first, float second, Write write) {
  if (write == Write::kAtomicAdd) {
    atomicAdd(y, first);
    atomicAdd(y + 1, second);
    return;
  }
  *reinterpret_cast<float2*>(y) = make_float2(first, second);
}

// The product with Hopper's own instructions: the copy engine brings 64-wide slices of K of x
// and w into shared memory (TMA, 128-byte swizzled), and wgmma multiplies a 64 × N tile a
// 16-deep step at a time from there. A block is a producer warp that keeps up to `stages` slices
// in flight and kConsumers warpgroups, which either take the slices in turn for one 64 × N tile
// (so that kConsumers chains of wgmmas run at once) and add their sums at the end, or with
// kByRows take 64 rows each of a 64·kConsumers × N tile (each slice of w then serves them all).
// As cuBLASLt's kernels do, N is any multiple of 8 (outputs past the last are read as zeros by
// TMA and not written), chosen so that the tiles about fill the GPU once, with whole K in flight
// where it fits.
constexpr int kGroupRows = 64, kMaxStages = 32;

// A block's first slices of w are asked for before it waits for the previous kernel (launched
// as Launch() does, it may start while that one ends): weights are never a kernel's output, so in
// a step they stream in beside the row kernel that makes x. Each consumer keeps one slice's
// wgmmas in flight while it issues its next slice's.
//
// With kCluster > 1, the blocks of a cluster (kCluster row tiles of the same outputs) share w's
// slices: each block's producer brings 1/kCluster of every slice into all of them (TMA multicast),
// so w crosses from L2 once per cluster instead of once per block. A stage is then refilled only
// once every consumer of the cluster is done with it, and no block ends before the others are
// done arriving on its barriers.
template <int kN, int kConsumers, int kCluster, bool kByRows>
__global__ void __launch_bounds__(128 * kConsumers + 32)
    WgmmaKernel(const __grid_constant__ CUtensorMap x_map,
                const __grid_constant__ CUtensorMap w_map, void* y, int in, int out, int stages,
                int tiles_per_split, Write write, Ablation ablation) {
  static_assert(kN % (8 * kCluster) == 0 && kN <= 256);
  constexpr int kTileRows = kByRows ? kGroupRows * kConsumers : kGroupRows;
  constexpr int kSliceConsumers = kByRows ? kConsumers : 1;  // Consumers of each slice.
  constexpr int kXElements = kTileRows * kSliceIn, kWElements = kN * kSliceIn;
  constexpr int kWPartRows = kN / kCluster;  // Of each slice of w, what one block brings.
  constexpr uint32_t kStageBytes = sizeof(bf16) * (kXElements + kWElements);
  extern __shared__ unsigned char shared[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  // Swizzled tiles start on 1,024-byte boundaries (the launch adds that much room).
  bf16* x_tiles =
      reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(shared) + 1023) & ~uintptr_t{1023});
  bf16* w_tiles = x_tiles + stages * kXElements;
  const int out0 = blockIdx.x * kN, row0 = blockIdx.y * kTileRows;
  const int first_tile = blockIdx.z * tiles_per_split;
  const int tiles = min(in / kSliceIn, first_tile + tiles_per_split) - first_tile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t rank = 0;
  if constexpr (kCluster > 1) asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      cuda::ptx::mbarrier_init(&full[s], 1);
      // Lane 0 of each warp of the slice's consumers, in every block of the cluster.
      cuda::ptx::mbarrier_init(&empty[s], 4 * kSliceConsumers * kCluster);
    }
    cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);
  }
  if constexpr (kCluster > 1) {
    SyncCluster();  // Every block's barriers are ready before any copy or arrival reaches them.
  } else {
    __syncthreads();
  }

  if (warp == 4 * kConsumers) {  // The producer.
    if (lane == 0 && ablation == Ablation::kComputeOnly) {
      WaitForPreviousKernel();
      for (int t = 0; t < tiles; ++t) {
        const int s = t % stages;
        if (t >= stages) WaitForPhase(&empty[s], (t / stages + 1) % 2);
        cuda::ptx::mbarrier_arrive(&full[s]);
      }
    } else if (lane == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(&w_map) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(&x_map) : "memory");
      auto load_w = [&](int t) {
        const int32_t at[2] = {(first_tile + t) * kSliceIn,
                               out0 + static_cast<int>(rank) * kWPartRows};
        bf16* part = w_tiles + (t % stages) * kWElements + rank * kWPartRows * kSliceIn;
        if constexpr (kCluster > 1) {
          cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, part,
                                          &w_map, at, &full[t % stages],
                                          static_cast<uint16_t>((1 << kCluster) - 1));
        } else {
          cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global, part,
                                          &w_map, at, &full[t % stages]);
        }
      };
      auto load_x = [&](int t) {
        const int32_t at[2] = {(first_tile + t) * kSliceIn, row0};
        cuda::ptx::cp_async_bulk_tensor(cuda::ptx::space_cluster, cuda::ptx::space_global,
                                        x_tiles + (t % stages) * kXElements, &x_map, at,
                                        &full[t % stages]);
      };
      ProduceSlices(full, empty, stages, tiles, kStageBytes, load_w, load_x);
    }
    if constexpr (kCluster > 1) {
      if (lane == 0) {
        for (int t = max(0, tiles - stages); t < tiles; ++t) {
          WaitForPhase(&empty[t % stages], (t / stages) % 2);
        }
      }
    }
    return;
  }

  // y is read (kAdd) and written only after the previous kernel has ended.
  WaitForPreviousKernel();
  auto release = [&](int s) {
    if (lane != 0) return;
    if constexpr (kCluster > 1) {
      for (uint32_t cta = 0; cta < kCluster; ++cta) ArriveInCluster(&empty[s], cta);
    } else {
      cuda::ptx::mbarrier_arrive(&empty[s]);
    }
  };
  const int consumer = warp / 4;
  const bf16* x_rows = x_tiles + (kByRows ? consumer * kGroupRows * kSliceIn : 0);
  const int first = kByRows ? 0 : consumer, step = kByRows ? 1 : kConsumers;
  if (ablation == Ablation::kDeliveryOnly) {  // Each stage released unread; nothing written.
    for (int t = first; t < tiles; t += step) {
      WaitForPhase(&full[t % stages], (t / stages) % 2);
      release(t % stages);
    }
    return;
  }
  // With kAdd, tiles up to 128 wide load y's sums before the product, while the first slices
  // arrive, as the engine's o_proj reads h: loaded after it, their round trip came last (about 3
  // of 1b o_proj's 15 µs at 64 × 64; bench/README.md v42). Wider tiles would spill them.
  constexpr bool kEarlyAdd = kN <= 128;
  const int group_row0 = row0 + (kByRows ? consumer * kGroupRows : 0);
  const int row = group_row0 + 16 * (warp % 4) + lane / 4;
  // f(i, y's sums for d[i] and d[i + 1]) for each pair of this thread's sums inside y.
  auto read_sums = [&](auto f) {
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
      const int column = out0 + 8 * j + 2 * (lane % 4);
      if (column >= out) break;
      const float* top = static_cast<const float*>(y) + static_cast<int64_t>(row) * out + column;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        f(4 * j + 2 * half, *reinterpret_cast<const float2*>(top + 8 * half * out));
      }
    }
  };
  float earlier[kEarlyAdd ? kN / 2 : 1];
  if constexpr (kEarlyAdd) {
    if (write == Write::kAdd && (kByRows || consumer == 0)) {
      read_sums([&](int i, float2 sums) {
        earlier[i] = sums.x;
        earlier[i + 1] = sums.y;
      });
    }
  }
  float d[kN / 2] = {};  // The engine's loop (tensor_core_products.cu).
  MultiplySlices<kN>(d, full, stages, x_rows, kXElements * sizeof(bf16), w_tiles,
                     kWElements * sizeof(bf16), first, step, tiles, release);
  if constexpr (kConsumers > 1 && !kByRows) {
    // The other consumers' sums come to the first through the stages, once every slice is used.
    float* partial = reinterpret_cast<float*>(x_tiles);
    const int thread = threadIdx.x % 128;
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
    if (consumer > 0) {
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) partial[((consumer - 1) * kN / 2 + i) * 128 + thread] = d[i];
    }
    asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
    if (consumer > 0) return;
    for (int c = 1; c < kConsumers; ++c) {
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) d[i] += partial[((c - 1) * kN / 2 + i) * 128 + thread];
    }
  }
  if constexpr (kN % 16 == 0) {  // So that the tile's channels start 16-byte aligned.
    if (write == Write::kSwiGlu) {
      // The activation tile is staged in shared memory (w's stages, all used by now), then written
      // 16 bytes a thread: stored from the sums' layout, a row's 2-byte pieces would be 8 bytes
      // apart.
      constexpr int kChannels = kN / 2;
      if constexpr (kByRows && kConsumers > 1) {
        // Every consumer is done with the stages before any writes over them.
        asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
      }
      bf16* staged = w_tiles + consumer * kGroupRows * kChannels;  // [kGroupRows][kChannels]
      const int top = 16 * (warp % 4) + lane / 4;
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        const int channel = 4 * j + lane % 4;
        staged[top * kChannels + channel] = __float2bfloat16(Swish(d[4 * j], d[4 * j + 1]));
        staged[(top + 8) * kChannels + channel] =
            __float2bfloat16(Swish(d[4 * j + 2], d[4 * j + 3]));
      }
      asm volatile("bar.sync %0, 128;" ::"r"(2 + consumer) : "memory");  // This warpgroup.
      const int width = out / 2, channel0 = out0 / 2;
      constexpr int kPieces = kChannels / 8;  // 16-byte pieces of a row.
      for (int piece = threadIdx.x % 128; piece < kGroupRows * kPieces; piece += 128) {
        const int r = piece / kPieces, c = piece % kPieces * 8;
        if (channel0 + c >= width) continue;
        *reinterpret_cast<uint4*>(static_cast<bf16*>(y) +
                                  static_cast<int64_t>(group_row0 + r) * width + channel0 + c) =
            *reinterpret_cast<const uint4*>(staged + r * kChannels + c);
      }
      return;
    }
  }
  if (write == Write::kAdd) {
    if constexpr (kEarlyAdd) {
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        if (out0 + 8 * j + 2 * (lane % 4) >= out) break;
#pragma unroll
        for (int i = 4 * j; i < 4 * j + 4; ++i) d[i] += earlier[i];
      }
    } else {
      // Every sum y holds is loaded before any is stored: one round trip to L2, not one a pair
      // of outputs (the compiler keeps each load after the stores before it, which may alias it).
      read_sums([&](int i, float2 sums) {
        d[i] += sums.x;
        d[i + 1] += sums.y;
      });
    }
    write = Write::kStore;
  }
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int column = out0 + 8 * j + 2 * (lane % 4);
    if (column >= out) break;
    float* top = static_cast<float*>(y) + static_cast<int64_t>(row) * out + column;
    float* bottom = top + 8 * static_cast<int64_t>(out);
    WriteSums(top, d[4 * j], d[4 * j + 1], write);
    WriteSums(bottom, d[4 * j + 2], d[4 * j + 3], write);
  }
}

struct Product {
  const char* preset;
  const char* name;
  int rows, in, out;
  bool accumulate;
  bool swiglu = false;  // Also timed with SwiGLU after it (gate_up).
};

// What one of our kernels must write, to be checked against: cuBLASLt's result, or with
// `swiglu` the activation made from it (bf16 [rows, out / 2]).
struct Expected {
  void* y;  // Where ours writes.
  const std::vector<float>& values;
  double largest;  // The largest magnitude among them.
  bool swiglu;
};

// Median milliseconds of 20 runs of `run`, each after `flush` (not timed).
template <typename Flush, typename Run>
double MedianMs(Flush flush, Run run) {
  EventTimer timer;
  std::vector<float> times;
  for (int i = 0; i < 23; ++i) {
    flush();
    const float ms = timer.Ms(run);
    if (i >= 3) times.push_back(ms);  // The first runs warm up.
  }
  CHECK_CUDA(cudaGetLastError());
  return Median(times);
}

void Report(const Product& p, const char* variant, double ms, double max_relative_diff,
            int splits) {
  const double flops = 2.0 * p.rows * p.in * p.out;
  std::printf(
      "{\"preset\":\"%s\",\"product\":\"%s\",\"rows\":%d,\"in\":%d,\"out\":%d,"
      "\"accumulate\":%s,\"variant\":\"%s\",\"us_p50\":%.2f,\"tflops\":%.1f",
      p.preset, p.name, p.rows, p.in, p.out, p.accumulate ? "true" : "false", variant, 1e3 * ms,
      flops / ms / 1e9);
  if (splits > 0) std::printf(",\"splits\":%d", splits);
  // Not finite where the result is wrong everywhere (as under TTT_GEMM_ABLATION=compute).
  if (!std::isfinite(max_relative_diff)) {
    std::printf(",\"max_relative_diff\":null");
  } else if (max_relative_diff >= 0) {
    std::printf(",\"max_relative_diff\":%.3g", max_relative_diff);
  }
  std::printf("}\n");
}

__global__ void EmptyKernel() {}

// In a step a product follows a row kernel that makes its input. BusyKernel stands in for one
// (256 blocks, 10 µs, letting the next kernel launch at once), and a product's time in the chain
// is the pair's less BusyKernel's alone: for ours launched as the engine launches its kernels
// (Launch(), so they may start early), for cuBLASLt's as it launches them. BusyKernel asks for
// the largest shared-memory carveout, which our products need: an SM holds blocks of one carveout
// at a time, and with the carveout the driver picks for a kernel of no shared memory, our blocks
// did not start beside it (each product up to 1.8 µs later).
__global__ void BusyKernel() {
  asm volatile("griddepcontrol.launch_dependents;");
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(256);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < 10000);
}

void LaunchBusy() { CHECK_CUDA(Launch(BusyKernel, 256, 192, 0, nullptr)); }

// Times and checks one of our kernels, `launch(grid_x, grid_y, splits, tiles_per_split, write)`,
// with K whole and, where the tiles are fewer than the SMs (and the sums are not an activation's),
// split so that there is about a block an SM, reported as `name` and `name`_split_k, alone and
// after BusyKernel (`…_chained`, `busy_ms` its time alone).
template <typename Launch, typename Flush>
void MeasureOurs(const Product& p, const std::string& name, int tile_rows, int tile_out, int sms,
                 Flush flush, double busy_ms, const Expected& expected, Launch launch) {
  if (p.rows % tile_rows != 0 || p.out % 8 != 0 || p.in % kSliceIn != 0) {
    std::fprintf(stderr, "%s %s: not in whole %d-row tiles of 8-output groups, %s skipped\n",
                 p.preset, p.name, tile_rows, name.c_str());
    return;
  }
  const size_t count = expected.values.size();
  const size_t bytes = count * (expected.swiglu ? sizeof(bf16) : sizeof(float));
  const int grid_x = (p.out + tile_out - 1) / tile_out, grid_y = p.rows / tile_rows;
  const int tiles = grid_x * grid_y, in_tiles = p.in / kSliceIn;
  const int wanted = std::clamp((sms + tiles / 2) / tiles, 1, in_tiles);
  std::vector<int> split_counts = {1};
  if (wanted > 1 && !expected.swiglu) split_counts.push_back(wanted);
  for (const int wanted_splits : split_counts) {
    const int per_split = (in_tiles + wanted_splits - 1) / wanted_splits;
    const int splits = (in_tiles + per_split - 1) / per_split;
    const Write write = expected.swiglu ? Write::kSwiGlu
                        : splits > 1    ? Write::kAtomicAdd
                        : p.accumulate  ? Write::kAdd
                                        : Write::kStore;
    auto zero = [&] {
      if (write == Write::kAtomicAdd && !p.accumulate) {
        CHECK_CUDA(cudaMemsetAsync(expected.y, 0, bytes));
      }
    };
    const double ms = MedianMs(flush, [&] {
      zero();
      launch(grid_x, grid_y, splits, per_split, write);
    });
    const double chained_ms = MedianMs(flush, [&] {
      zero();
      LaunchBusy();
      launch(grid_x, grid_y, splits, per_split, write);
    });
    CHECK_CUDA(cudaMemset(expected.y, 0, bytes));
    launch(grid_x, grid_y, splits, per_split, write);
    std::vector<float> ours(count);
    if (expected.swiglu) {
      std::vector<bf16> act(count);
      CHECK_CUDA(cudaMemcpy(act.data(), expected.y, bytes, cudaMemcpyDeviceToHost));
      for (size_t e = 0; e < count; ++e) ours[e] = __bfloat162float(act[e]);
    } else {
      CHECK_CUDA(cudaMemcpy(ours.data(), expected.y, bytes, cudaMemcpyDeviceToHost));
    }
    double diff = 0;
    for (size_t e = 0; e < count; ++e) {
      diff = std::max(diff, std::fabs(static_cast<double>(expected.values[e]) - ours[e]));
    }
    const std::string variant = name + (splits > 1 ? "_split_k" : "");
    const double relative_diff = expected.largest > 0 ? diff / expected.largest : diff;
    Report(p, variant.c_str(), ms, relative_diff, splits);
    Report(p, (variant + "_chained").c_str(), chained_ms - busy_ms, relative_diff, splits);
  }
}

// SwizzledTileMap's map, or the program ends with the error.
CUtensorMap TileMap(const bf16* matrix, int rows, int in, int box_rows) {
  CUtensorMap map;
  CHECK_CUDA(ttt::kernels::cuda::SwizzledTileMap(matrix, rows, in, box_rows, 1, &map));
  return map;
}

// Launch() with clusters of `cluster` blocks.
template <typename... Params, typename... Args>
cudaError_t LaunchClusters(void (*kernel)(Params...), dim3 grid, int threads, size_t shared_bytes,
                           dim3 cluster, Args... args) {
  cudaLaunchAttribute attributes[2] = {};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = cluster.x;
  attributes[1].val.clusterDim.y = cluster.y;
  attributes[1].val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = threads;
  config.dynamicSmemBytes = shared_bytes;
  config.attrs = attributes;
  config.numAttrs = 2;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// Ours at tile width kN, where its tiles number between an eighth of the SMs and twice them.
template <int kN, int kConsumers, int kCluster, bool kByRows, typename Flush>
void RunWgmma(const Product& p, const bf16* x, const bf16* w, const Expected& expected, int sms,
              Flush flush, double busy_ms) {
  if constexpr (kN % (8 * kCluster) == 0) {
    // The activation's tiles start 16-byte aligned (see WgmmaKernel).
    if (expected.swiglu && kN % 16 != 0) return;
    constexpr int kTileRows = kByRows ? kGroupRows * kConsumers : kGroupRows;
    const int tiles = (p.out + kN - 1) / kN * (p.rows / kTileRows);
    if (8 * tiles < sms || tiles > 2 * sms || (p.rows / kTileRows) % kCluster != 0) return;
    const auto kernel = WgmmaKernel<kN, kConsumers, kCluster, kByRows>;
    const size_t stage_bytes = sizeof(bf16) * (kTileRows + kN) * kSliceIn;
    constexpr size_t kSharedLimit = 227 * 1024 - 1024 - 2 * kMaxStages * sizeof(uint64_t);
    const int stages =
        std::min<int>({kMaxStages, p.in / kSliceIn, static_cast<int>(kSharedLimit / stage_bytes)});
    if (stages < kConsumers + 1) return;
    // The other consumers' sums pass through the stages.
    constexpr size_t kPartialBytes = kByRows ? 0 : sizeof(float) * (kConsumers - 1) * kN / 2 * 128;
    if constexpr (kPartialBytes > 0) {
      if (stages * stage_bytes < kPartialBytes) return;
    }
    const size_t shared_bytes = stages * stage_bytes + 1024;
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(shared_bytes)));
    const CUtensorMap x_map = TileMap(x, p.rows, p.in, kTileRows);
    const CUtensorMap w_map = TileMap(w, p.out, p.in, kN / kCluster);
    const char* ablation_name = std::getenv("TTT_GEMM_ABLATION");
    const Ablation ablation = !ablation_name                             ? Ablation::kNone
                              : std::string(ablation_name) == "delivery" ? Ablation::kDeliveryOnly
                                                                         : Ablation::kComputeOnly;
    const std::string name =
        "wgmma_" + std::to_string(kTileRows) + "x" + std::to_string(kN) + "_" +
        std::to_string(stages) + "stages_" + std::to_string(kConsumers) + "consumers" +
        (kCluster > 1 ? "_cluster" + std::to_string(kCluster) : std::string()) +
        (expected.swiglu ? "_swiglu" : "") +
        (ablation_name ? std::string("_") + ablation_name + "_only" : "");
    MeasureOurs(
        p, name, kTileRows, kN, sms, flush, busy_ms, expected,
        [&](int grid_x, int grid_y, int splits, int per_split, Write write) {
          CHECK_CUDA(LaunchClusters(kernel, dim3(grid_x, grid_y, splits), 128 * kConsumers + 32,
                                    shared_bytes, dim3(1, kCluster, 1), x_map, w_map, expected.y,
                                    p.in, p.out, stages, per_split, write, ablation));
        });
  }
}

// ClusterSplitKernel at tile width kN with K split `splits` ways, where its blocks fill the SMs
// once and every cluster fits.
template <int kN, int kPairs, typename Flush>
void RunClusterSplit(const Product& p, const bf16* x, const bf16* w, const Expected& expected,
                     int splits, int sms, Flush flush, double busy_ms) {
  const int tiles = ((p.out + kN - 1) / kN + kPairs - 1) / kPairs * kPairs;
  const int in_tiles = p.in / kSliceIn;
  if (p.rows != kClusterRows || p.out % 4 != 0 || p.in % kSliceIn != 0 || expected.swiglu ||
      tiles * splits > sms || kClusterRows % splits != 0 || kPairs * splits > 8) {
    return;
  }
  const int per_split = (in_tiles + splits - 1) / splits;
  if ((splits - 1) * per_split >= in_tiles) return;  // A split would have no slice.
  const auto kernel = ClusterSplitKernel<kN, kPairs>;
  const size_t stage_bytes = sizeof(bf16) * (kClusterRows + kN) * kSliceIn;
  constexpr size_t kSharedLimit = 227 * 1024 - 1024 - 2 * kClusterMaxStages * sizeof(uint64_t);
  const int stages =
      std::min<int>({kClusterMaxStages, per_split, static_cast<int>(kSharedLimit / stage_bytes)});
  const size_t shared_bytes = ClusterSplitSharedBytes<kN>(stages);
  if (shared_bytes > kSharedLimit + 1024) return;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(shared_bytes)));
  const CUtensorMap x_map = TileMap(x, p.rows, p.in, kClusterRows / kPairs);
  const CUtensorMap w_map = TileMap(w, p.out, p.in, kN);
  const ClusterSplitOutput output{.y = static_cast<float*>(expected.y),
                                  .ld = p.out,
                                  .rows = p.rows,
                                  .out = p.out,
                                  .add = p.accumulate};
  const dim3 grid(tiles, 1, splits), cluster(kPairs, 1, splits);
  auto launch = [&] {
    CHECK_CUDA(LaunchClusters(kernel, grid, kClusterThreads, shared_bytes, cluster, x_map, w_map,
                              p.in, stages, per_split, output));
  };
  // How many clusters the GPU holds at once: fewer than the grid's and it runs in two waves.
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster.x;
  attribute.val.clusterDim.y = cluster.y;
  attribute.val.clusterDim.z = cluster.z;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = kClusterThreads;
  config.dynamicSmemBytes = shared_bytes;
  config.attrs = &attribute;
  config.numAttrs = 1;
  int resident = 0;
  CHECK_CUDA(cudaOccupancyMaxActiveClusters(&resident, kernel, &config));
  const size_t count = expected.values.size();
  const size_t bytes = count * sizeof(float);
  const double ms = MedianMs(flush, launch);
  const double chained_ms = MedianMs(flush, [&] {
    LaunchBusy();
    launch();
  });
  CHECK_CUDA(cudaMemset(expected.y, 0, bytes));
  launch();
  std::vector<float> ours(count);
  CHECK_CUDA(cudaMemcpy(ours.data(), expected.y, bytes, cudaMemcpyDeviceToHost));
  double diff = 0;
  for (size_t e = 0; e < count; ++e) {
    diff = std::max(diff, std::fabs(static_cast<double>(expected.values[e]) - ours[e]));
  }
  const double relative_diff = expected.largest > 0 ? diff / expected.largest : diff;
  const int clusters = tiles / kPairs;
  const std::string name = "cluster_split_256x" + std::to_string(kN) + "_" +
                           std::to_string(stages) + "stages_k" + std::to_string(splits) +
                           (kPairs > 1 ? "_x_pairs" : "") + "_" + std::to_string(resident) +
                           "_of_" + std::to_string(clusters) + "_clusters_resident";
  Report(p, name.c_str(), ms, relative_diff, splits);
  Report(p, (name + "_chained").c_str(), chained_ms - busy_ms, relative_diff, splits);
}

template <int kConsumers, int kCluster, bool kByRows, int... kWidths, typename... Args>
void RunWgmmaWidths(std::integer_sequence<int, kWidths...>, Args&&... args) {
  (RunWgmma<kWidths, kConsumers, kCluster, kByRows>(args...), ...);
}

}  // namespace

int main(int argc, char** argv) {
  // Optional: one product, as PRESET/PRODUCT (for a profiler run).
  const std::string only = argc > 1 ? argv[1] : "";
  // The decode products at 256 rows (the engine's shapes: in_proj's width padded to 64).
  const Product products[] = {
      {"125m", "in_proj", 256, 768, 2368, false},
      {"125m", "o_proj", 256, 768, 768, true},
      {"125m", "gate_up", 256, 768, 4096, false, true},
      {"125m", "down", 256, 2048, 768, true},
      {"125m", "lm_head", 256, 768, 32000, false},
      {"1b", "in_proj", 256, 2048, 6208, false},
      {"1b", "o_proj", 256, 2048, 2048, true},
      {"1b", "gate_up", 256, 2048, 11008, false, true},
      {"1b", "down", 256, 5504, 2048, true},
      {"1b", "lm_head", 256, 2048, 32000, false},
  };
  int device = 0, sms = 0, l2_bytes = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  CHECK_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
  const size_t flush_bytes = 2 * static_cast<size_t>(l2_bytes);
  void* flush_buffer;
  CHECK_CUDA(cudaMalloc(&flush_buffer, flush_bytes));
  const size_t workspace_bytes = size_t{32} << 20;
  void* workspace;
  CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
  cublasLtHandle_t handle;
  CHECK_CUBLAS(cublasLtCreate(&handle));
  std::mt19937 rng(7);
  int flushes = 0;
  const char* l2 = std::getenv("TTT_GEMM_L2");
  const bool warm = l2 != nullptr && std::string(l2) == "warm";
  auto flush = [&] {
    if (!warm) CHECK_CUDA(cudaMemsetAsync(flush_buffer, ++flushes, flush_bytes));
  };

  // What the timing itself costs: an empty kernel, timed as the products are.
  std::printf("{\"variant\":\"empty_kernel\",\"us_p50\":%.2f}\n",
              1e3 * MedianMs(flush, [] { EmptyKernel<<<1, 32>>>(); }));
  CHECK_CUDA(cudaFuncSetAttribute(BusyKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared));
  const double busy_ms = MedianMs(flush, LaunchBusy);
  std::printf("{\"variant\":\"busy_kernel\",\"us_p50\":%.2f}\n", 1e3 * busy_ms);
  // What any kernel launched as Launch() adds after it: the floor of every `…_chained` figure.
  const double chained_empty_ms = MedianMs(flush, [] {
    LaunchBusy();
    CHECK_CUDA(Launch(EmptyKernel, 1, 32, 0, nullptr));
  });
  std::printf("{\"variant\":\"empty_kernel_chained\",\"us_p50\":%.2f}\n",
              1e3 * (chained_empty_ms - busy_ms));

  for (const Product& p : products) {
    if (!only.empty() && only != std::string(p.preset) + "/" + p.name) continue;
    const ProductInputs inputs = UploadProductInputs(p.rows, p.in, p.out, rng);
    const bf16 *x = inputs.x, *w = inputs.w;
    const size_t y_count = static_cast<size_t>(p.rows) * p.out;
    float *y_lt, *y_ours;
    CHECK_CUDA(cudaMalloc(&y_lt, y_count * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&y_ours, y_count * sizeof(float)));

    const LtPlan plan = PlanLt(handle, p.rows, p.in, p.out, workspace_bytes);
    const float alpha = 1.0f, beta = p.accumulate ? 1.0f : 0.0f;
    auto run_lt = [&] {
      CHECK_CUBLAS(cublasLtMatmul(handle, plan.desc, &alpha, w, plan.w, x, plan.x, &beta, y_lt,
                                  plan.y, y_lt, plan.y, &plan.algo, workspace, workspace_bytes,
                                  nullptr));
    };
    const double lt_ms = MedianMs(flush, run_lt);

    CHECK_CUDA(cudaMemset(y_lt, 0, y_count * sizeof(float)));
    run_lt();  // From zero: the result ours are compared with.
    std::vector<float> lt(y_count);
    CHECK_CUDA(cudaMemcpy(lt.data(), y_lt, y_count * sizeof(float), cudaMemcpyDeviceToHost));
    double largest = 0;
    for (float v : lt) largest = std::max(largest, std::fabs(static_cast<double>(v)));
    Report(p, "cublaslt", lt_ms, -1, 0);

    Report(p, "cublaslt_chained",
           MedianMs(flush,
                    [&] {
                      LaunchBusy();
                      run_lt();
                    }) -
               busy_ms,
           -1, 0);

    constexpr std::integer_sequence<int, 24, 32, 48, 64, 72, 96, 128, 168, 192, 256> kWidths;
    const Expected sums{y_ours, lt, largest, false};
    RunWgmmaWidths<1, 1, false>(kWidths, p, x, w, sums, sms, flush, busy_ms);
    RunWgmmaWidths<2, 1, false>(kWidths, p, x, w, sums, sms, flush, busy_ms);
    RunWgmmaWidths<1, 2, false>(kWidths, p, x, w, sums, sms, flush, busy_ms);
    RunWgmmaWidths<2, 2, false>(kWidths, p, x, w, sums, sms, flush, busy_ms);
    RunWgmmaWidths<2, 1, true>(kWidths, p, x, w, sums, sms, flush, busy_ms);
    RunWgmmaWidths<2, 2, true>(kWidths, p, x, w, sums, sms, flush, busy_ms);
    for (const int splits : {2, 4, 8}) {
      RunClusterSplit<64, 1>(p, x, w, sums, splits, sms, flush, busy_ms);
      RunClusterSplit<96, 1>(p, x, w, sums, splits, sms, flush, busy_ms);
      RunClusterSplit<128, 1>(p, x, w, sums, splits, sms, flush, busy_ms);
      RunClusterSplit<64, 2>(p, x, w, sums, splits, sms, flush, busy_ms);
      RunClusterSplit<96, 2>(p, x, w, sums, splits, sms, flush, busy_ms);
    }

    if (p.swiglu) {
      // As the engine runs it: cuBLASLt's product, then its SwiGLU kernel; against ours with
      // SwiGLU in the epilogue.
      const int channels = p.out / 2;
      bf16* act;
      CHECK_CUDA(cudaMalloc(&act, sizeof(bf16) * p.rows * channels));
      auto run_lt_swiglu = [&] {
        run_lt();
        CHECK_CUDA(ttt::kernels::cuda::SwiGlu(y_lt, ttt::kernels::cuda::ElementType::kFloat32,
                                              p.rows, channels, act,
                                              ttt::kernels::cuda::ElementType::kBFloat16, nullptr));
      };
      Report(p, "cublaslt_then_swiglu", MedianMs(flush, run_lt_swiglu), -1, 0);
      Report(p, "cublaslt_then_swiglu_chained",
             MedianMs(flush,
                      [&] {
                        LaunchBusy();
                        run_lt_swiglu();
                      }) -
                 busy_ms,
             -1, 0);
      std::vector<float> activation(static_cast<size_t>(p.rows) * channels);
      double largest_activation = 0;
      for (size_t e = 0; e < activation.size(); ++e) {
        activation[e] = Swish(lt[2 * e], lt[2 * e + 1]);
        largest_activation =
            std::max(largest_activation, std::fabs(static_cast<double>(activation[e])));
      }
      const Expected swiglu{act, activation, largest_activation, true};
      RunWgmmaWidths<1, 1, false>(kWidths, p, x, w, swiglu, sms, flush, busy_ms);
      RunWgmmaWidths<2, 1, false>(kWidths, p, x, w, swiglu, sms, flush, busy_ms);
      RunWgmmaWidths<2, 1, true>(kWidths, p, x, w, swiglu, sms, flush, busy_ms);
      CHECK_CUDA(cudaFree(act));
    }

    DestroyLt(plan);
    FreeProductInputs(inputs);
    CHECK_CUDA(cudaFree(y_lt));
    CHECK_CUDA(cudaFree(y_ours));
  }
  cublasLtDestroy(handle);
  CHECK_CUDA(cudaFree(workspace));
  CHECK_CUDA(cudaFree(flush_buffer));
  return 0;
}
