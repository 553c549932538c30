// What a tensor-core kernel of our own reaches on a decode step's dense products at 256 rows,
// against the cuBLASLt kernel the engine runs (its heuristic's first: see server/engine/
// cuda_gemm.h). Each product is y [rows, out] (+)= x [rows, in] · wᵀ, bf16 in, float32 out, for
// the 125m and 1b presets' shapes:
//   cublaslt       the heuristic's first kernel, planned as CudaGemm plans it.
//   mma_RxO_Sstages  ours: R × O output tiles (rows × outputs) of mma.sync (bf16, float32
//                  sums), four warps a block, fed by an S-stage cp.async pipeline: tiles of
//                  128 × 64, 64 × 64, 64 × 32 and 32 × 64 (the smaller ones give the small
//                  products as many blocks as cuBLASLt's kernels have), 3 to 10 stages.
//   …_split_k      the same where the tiles are too few to fill the GPU twice over, with K
//                  split among blocks that add their sums into y atomically (y zeroed first
//                  when the product stores: that memset is timed with it).
// L2 is flushed before every timed run: in a step each product's weights were last read a
// whole step ago. An empty kernel timed the same way comes first (the timing's own cost). Prints one JSON line per (preset, product, variant): the median of 20 runs,
// TFLOP/s, and for ours the largest difference from cuBLASLt's result over its largest value.
//   ttt-decode-gemm
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "bench/cuda_check.h"

namespace {

using bf16 = __nv_bfloat16;

constexpr int kTileIn = 64, kThreads = 128;
// Shared rows of kTileIn + 8 elements (144 bytes apart): the eight rows an ldmatrix reads fall
// in different banks.
constexpr int kSharedLd = kTileIn + 8;

template <int kTileRows, int kTileOut>
struct Stage {
  bf16 x[kTileRows][kSharedLd];
  bf16 w[kTileOut][kSharedLd];
};

__device__ __forceinline__ void CopyAsync16(void* shared, const void* global) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global));
}

__device__ __forceinline__ void CommitCopies() { asm volatile("cp.async.commit_group;"); }

template <int kPending>
__device__ __forceinline__ void WaitForCopies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

// Four 8 × 8 bf16 matrices from shared memory, lanes 8i … 8i + 7 giving matrix i's row addresses.
__device__ __forceinline__ void LoadMatrices(const bf16* row, uint32_t (&r)[4]) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// c (16 × 8, float32) += a (16 × 16, bf16) · b (16 × 8, bf16).
__device__ __forceinline__ void MultiplyAdd(float (&c)[4], const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// How a block writes its sums: y = sums, y += sums (the only writer), or atomically added.
enum class Write { kStore, kAdd, kAtomicAdd };

__device__ __forceinline__ void WriteSum(float* y, float sum, Write write) {
  if (write == Write::kAtomicAdd) {
    atomicAdd(y, sum);
  } else {
    *y = write == Write::kAdd ? *y + sum : sum;
  }
}

// Block (blockIdx.x, blockIdx.y, blockIdx.z): outputs [O·x, O·x + O) of rows [R·y, R·y + R),
// over the z-th split of K (tiles_per_split tiles of 64). Four warps, two by two, each R/2 rows ×
// O/2 outputs: kI × kJ mma tiles of 16 × 8. K's tiles come through kStages stages of shared memory,
// kStages − 1 of them in flight.
template <int kTileRows, int kTileOut, int kStages>
__global__ void __launch_bounds__(kThreads)
    MmaSplitKKernel(const bf16* x, const bf16* w, float* y, int in, int out, int tiles_per_split,
                    Write write) {
  using Stage = ::Stage<kTileRows, kTileOut>;
  constexpr int kI = kTileRows / 2 / 16, kJ = kTileOut / 2 / 8;
  static_assert(kI >= 1 && kJ % 2 == 0, "b's fragments are loaded 16 outputs at a time");
  extern __shared__ __align__(16) unsigned char shared[];
  Stage* stages = reinterpret_cast<Stage*>(shared);
  const int out0 = blockIdx.x * kTileOut, row0 = blockIdx.y * kTileRows;
  const int first_tile = blockIdx.z * tiles_per_split;
  const int tiles = min(in / kTileIn, first_tile + tiles_per_split) - first_tile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_row = (warp / 2) * (kTileRows / 2), warp_out = (warp % 2) * (kTileOut / 2);

  auto load = [&](int stage, int tile) {
    const int k0 = (first_tile + tile) * kTileIn;
    constexpr int kChunks = kTileIn / 8;  // 16-byte pieces per tile row.
    Stage& s = stages[stage];
    for (int c = threadIdx.x; c < kTileRows * kChunks; c += kThreads) {
      const int r = c / kChunks, piece = c % kChunks;
      CopyAsync16(&s.x[r][piece * 8], x + static_cast<int64_t>(row0 + r) * in + k0 + piece * 8);
    }
    for (int c = threadIdx.x; c < kTileOut * kChunks; c += kThreads) {
      const int r = c / kChunks, piece = c % kChunks;
      CopyAsync16(&s.w[r][piece * 8], w + static_cast<int64_t>(out0 + r) * in + k0 + piece * 8);
    }
  };

  float sums[kI][kJ][4] = {};  // [16-row tile][8-output tile][fragment]
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) load(s, s);
    CommitCopies();
  }
  for (int t = 0; t < tiles; ++t) {
    WaitForCopies<kStages - 2>();
    __syncthreads();  // Tile t is in; every warp is done with the stage loaded next.
    if (t + kStages - 1 < tiles) load((t + kStages - 1) % kStages, t + kStages - 1);
    CommitCopies();
    const Stage& s = stages[t % kStages];
#pragma unroll
    for (int k = 0; k < kTileIn; k += 16) {
      uint32_t a[kI][4], b[kJ][2];
#pragma unroll
      for (int i = 0; i < kI; ++i) {
        LoadMatrices(&s.x[warp_row + i * 16 + lane % 16][k + (lane / 16) * 8], a[i]);
      }
#pragma unroll
      for (int j = 0; j < kJ / 2; ++j) {
        uint32_t r[4];
        LoadMatrices(&s.w[warp_out + j * 16 + lane % 8 + (lane / 16) * 8][k + (lane / 8) % 2 * 8],
                     r);
        b[2 * j][0] = r[0], b[2 * j][1] = r[1], b[2 * j + 1][0] = r[2], b[2 * j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < kI; ++i) {
#pragma unroll
        for (int j = 0; j < kJ; ++j) MultiplyAdd(sums[i][j], a[i], b[j]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kI; ++i) {
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      const int row = row0 + warp_row + i * 16 + lane / 4;
      const int column = out0 + warp_out + j * 8 + (lane % 4) * 2;
      float* top = y + static_cast<int64_t>(row) * out + column;
      float* bottom = top + 8 * static_cast<int64_t>(out);
      WriteSum(top, sums[i][j][0], write);
      WriteSum(top + 1, sums[i][j][1], write);
      WriteSum(bottom, sums[i][j][2], write);
      WriteSum(bottom + 1, sums[i][j][3], write);
    }
  }
}

struct Product {
  const char* preset;
  const char* name;
  int rows, in, out;
  bool accumulate;
};

// cuBLASLt's plan for a shape, as CudaGemm makes it: row-major y = x · wᵀ is column-major
// yᵀ = w · xᵀ, w read as column-major [in, out] and transposed.
struct LtPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t w, x, y;
  cublasLtMatmulAlgo_t algo;
};

LtPlan PlanLt(cublasLtHandle_t handle, const Product& p, size_t workspace_bytes) {
  LtPlan plan{};
  CHECK_CUBLAS(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T;
  CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                              sizeof(transpose)));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.w, CUDA_R_16BF, p.in, p.out, p.in));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.x, CUDA_R_16BF, p.in, p.rows, p.in));
  CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&plan.y, CUDA_R_32F, p.out, p.rows, p.out));
  cublasLtMatmulPreference_t preference;
  CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&preference));
  const uint64_t bytes = workspace_bytes;
  CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CHECK_CUBLAS(cublasLtMatmulAlgoGetHeuristic(handle, plan.desc, plan.w, plan.x, plan.y, plan.y,
                                              preference, 1, &result, &found));
  cublasLtMatmulPreferenceDestroy(preference);
  if (found == 0) {
    std::fprintf(stderr, "no cuBLASLt kernel for %s %s\n", p.preset, p.name);
    std::exit(1);
  }
  plan.algo = result.algo;
  return plan;
}

void DestroyLt(const LtPlan& plan) {
  cublasLtMatrixLayoutDestroy(plan.y);
  cublasLtMatrixLayoutDestroy(plan.x);
  cublasLtMatrixLayoutDestroy(plan.w);
  cublasLtMatmulDescDestroy(plan.desc);
}

// Median milliseconds of 20 runs of `run`, each after `flush` (not timed).
template <typename Flush, typename Run>
double MedianMs(Flush flush, Run run) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int i = 0; i < 23; ++i) {
    flush();
    CHECK_CUDA(cudaEventRecord(start));
    run();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 3) times.push_back(ms);  // The first runs warm up.
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

std::vector<bf16> RandomBf16(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<bf16> v(n);
  for (bf16& e : v) e = __float2bfloat16(normal(rng));
  return v;
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
  if (max_relative_diff >= 0) std::printf(",\"max_relative_diff\":%.3g", max_relative_diff);
  std::printf("}\n");
}

__global__ void EmptyKernel() {}

// Ours with R × O tiles, K whole and split so that there are about two blocks per SM; each
// checked against cuBLASLt's result `lt` (largest magnitude `largest`).
template <int kTileRows, int kTileOut, int kStages, typename Flush>
void RunOurs(const Product& p, const bf16* x, const bf16* w, float* y, const std::vector<float>& lt,
             double largest, int sms, Flush flush) {
  if (p.rows % kTileRows != 0 || p.out % kTileOut != 0 || p.in % kTileIn != 0) {
    std::fprintf(stderr, "%s %s: not in whole %d x %d tiles\n", p.preset, p.name, kTileRows,
                 kTileOut);
    std::exit(1);
  }
  const auto kernel = MmaSplitKKernel<kTileRows, kTileOut, kStages>;
  const size_t shared_bytes = kStages * sizeof(Stage<kTileRows, kTileOut>);
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(shared_bytes)));
  const size_t y_count = lt.size();
  std::vector<float> ours(y_count);
  const int tiles = (p.out / kTileOut) * (p.rows / kTileRows), in_tiles = p.in / kTileIn;
  const int wanted = std::clamp((2 * sms + tiles - 1) / tiles, 1, in_tiles);
  std::vector<int> split_counts = {1};
  if (wanted > 1) split_counts.push_back(wanted);
  for (const int wanted_splits : split_counts) {
    const int per_split = (in_tiles + wanted_splits - 1) / wanted_splits;
    const int splits = (in_tiles + per_split - 1) / per_split;
    const dim3 grid(p.out / kTileOut, p.rows / kTileRows, splits);
    const Write write =
        splits > 1 ? Write::kAtomicAdd : (p.accumulate ? Write::kAdd : Write::kStore);
    auto run = [&] {
      if (!p.accumulate && splits > 1) {
        CHECK_CUDA(cudaMemsetAsync(y, 0, y_count * sizeof(float)));
      }
      kernel<<<grid, kThreads, shared_bytes>>>(x, w, y, p.in, p.out, per_split, write);
    };
    const double ms = MedianMs(flush, run);
    CHECK_CUDA(cudaMemset(y, 0, y_count * sizeof(float)));
    run();
    CHECK_CUDA(cudaMemcpy(ours.data(), y, y_count * sizeof(float), cudaMemcpyDeviceToHost));
    double diff = 0;
    for (size_t e = 0; e < y_count; ++e) {
      diff = std::max(diff, std::fabs(static_cast<double>(lt[e]) - ours[e]));
    }
    char name[32];
    std::snprintf(name, sizeof(name), "mma_%dx%d_%dstages%s", kTileRows, kTileOut, kStages,
                  splits > 1 ? "_split_k" : "");
    Report(p, name, ms, largest > 0 ? diff / largest : diff, splits);
  }
}

}  // namespace

int main() {
  // The decode products at 256 rows (the engine's shapes: in_proj's width padded to 64).
  const Product products[] = {
      {"125m", "in_proj", 256, 768, 2368, false},  {"125m", "o_proj", 256, 768, 768, true},
      {"125m", "gate_up", 256, 768, 4096, false},  {"125m", "down", 256, 2048, 768, true},
      {"125m", "lm_head", 256, 768, 32000, false}, {"1b", "in_proj", 256, 2048, 6208, false},
      {"1b", "o_proj", 256, 2048, 2048, true},     {"1b", "gate_up", 256, 2048, 11008, false},
      {"1b", "down", 256, 5504, 2048, true},       {"1b", "lm_head", 256, 2048, 32000, false},
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
  auto flush = [&] { CHECK_CUDA(cudaMemsetAsync(flush_buffer, ++flushes, flush_bytes)); };

  // What the timing itself costs: an empty kernel, timed as the products are.
  std::printf("{\"variant\":\"empty_kernel\",\"us_p50\":%.2f}\n",
              1e3 * MedianMs(flush, [] { EmptyKernel<<<1, 32>>>(); }));

  for (const Product& p : products) {
    const std::vector<bf16> host_x = RandomBf16(static_cast<size_t>(p.rows) * p.in, rng);
    const std::vector<bf16> host_w = RandomBf16(static_cast<size_t>(p.out) * p.in, rng);
    const size_t y_count = static_cast<size_t>(p.rows) * p.out;
    bf16 *x, *w;
    float *y_lt, *y_ours;
    CHECK_CUDA(cudaMalloc(&x, host_x.size() * sizeof(bf16)));
    CHECK_CUDA(cudaMalloc(&w, host_w.size() * sizeof(bf16)));
    CHECK_CUDA(cudaMalloc(&y_lt, y_count * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&y_ours, y_count * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(x, host_x.data(), host_x.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(w, host_w.data(), host_w.size() * sizeof(bf16), cudaMemcpyHostToDevice));

    const LtPlan plan = PlanLt(handle, p, workspace_bytes);
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

    RunOurs<128, 64, 3>(p, x, w, y_ours, lt, largest, sms, flush);
    RunOurs<64, 64, 3>(p, x, w, y_ours, lt, largest, sms, flush);
    RunOurs<64, 64, 6>(p, x, w, y_ours, lt, largest, sms, flush);
    RunOurs<64, 32, 3>(p, x, w, y_ours, lt, largest, sms, flush);
    RunOurs<64, 32, 6>(p, x, w, y_ours, lt, largest, sms, flush);
    RunOurs<64, 32, 10>(p, x, w, y_ours, lt, largest, sms, flush);
    RunOurs<32, 64, 6>(p, x, w, y_ours, lt, largest, sms, flush);

    DestroyLt(plan);
    CHECK_CUDA(cudaFree(x));
    CHECK_CUDA(cudaFree(w));
    CHECK_CUDA(cudaFree(y_lt));
    CHECK_CUDA(cudaFree(y_ours));
  }
  cublasLtDestroy(handle);
  CHECK_CUDA(cudaFree(workspace));
  CHECK_CUDA(cudaFree(flush_buffer));
  return 0;
}
