// Next-token choice on the GPU, one block per row of logits, so only ids and log-probs leave it.
//
// The kept set is every token whose tempered score reaches a threshold (from top-k, min-p and
// top-p, found by bisection on the value instead of a sort), and the draw walks the kept tokens in
// id order: the same rule as the CPU sampler, so both pick the same token for the same seed
// whenever their kept sets agree.
#include <cfloat>
#include <climits>

#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kBisectionSteps = 40;

__device__ float BlockMax(float v, float* scratch) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % kWarp == 0) scratch[threadIdx.x / kWarp] = v;
  __syncthreads();
  v = threadIdx.x % kWarp < blockDim.x / kWarp ? scratch[threadIdx.x % kWarp] : -FLT_MAX;
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The minimum of v over the block; every thread gets it.
__device__ int BlockMin(int v, int* scratch_int) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if (threadIdx.x % kWarp == 0) scratch_int[threadIdx.x / kWarp] = v;
  __syncthreads();
  v = threadIdx.x % kWarp < blockDim.x / kWarp ? scratch_int[threadIdx.x % kWarp] : INT_MAX;
  for (int o = kWarp / 2; o > 0; o /= 2) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// What greedy decoding and every log-prob need of a row of logits: its maximum, the first id
// holding it (ties go to the lowest id), and Σ exp(l − top). One pass over the row builds it.
// (A plain aggregate, so that it can live in shared memory.)
struct RowSummary {
  float top;
  int first;
  float sum;  // Of exp(l − top).

  static __device__ RowSummary Empty() { return {-FLT_MAX, INT_MAX, 0.0f}; }

  // Logits id .. id + 3 (−∞ for none). A quad rescales the sum at most once, and its exps are
  // __expf's (ex2.approx: a log-prob moves by ~1e-6): with expf and a test a logit, a block
  // issued ~40 instructions a logit, its merges included (bench/README.md v37).
  __device__ void Add(float4 l, int id) {
    const float quad_top = fmaxf(fmaxf(l.x, l.y), fmaxf(l.z, l.w));
    if (quad_top >= top) {
      const int quad_first = l.x == quad_top   ? id
                             : l.y == quad_top ? id + 1
                             : l.z == quad_top ? id + 2
                                               : id + 3;
      if (quad_top > top) {
        sum *= __expf(top - quad_top);
        top = quad_top;
        first = quad_first;
      } else {
        first = min(first, quad_first);
      }
    }
    sum += (__expf(l.x - top) + __expf(l.y - top)) + (__expf(l.z - top) + __expf(l.w - top));
  }
  __device__ void Merge(const RowSummary& other) {
    const float merged_top = fmaxf(top, other.top);
    sum = sum * expf(top - merged_top) + other.sum * expf(other.top - merged_top);
    first = top == other.top ? min(first, other.first) : (top > other.top ? first : other.first);
    top = merged_top;
  }
};

__device__ RowSummary WarpMerge(RowSummary s) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    RowSummary other;
    other.top = __shfl_xor_sync(0xffffffffu, s.top, o);
    other.first = __shfl_xor_sync(0xffffffffu, s.first, o);
    other.sum = __shfl_xor_sync(0xffffffffu, s.sum, o);
    s.Merge(other);
  }
  return s;
}

// The row's summary, for every thread of the block; the loads are 16-byte where the row allows.
__device__ RowSummary SummarizeRow(const float* row, int V, RowSummary* scratch) {
  RowSummary mine = RowSummary::Empty();
  if (V % 4 == 0 && reinterpret_cast<uintptr_t>(row) % 16 == 0) {
    const float4* quads = reinterpret_cast<const float4*>(row);
    for (int q = threadIdx.x; q < V / 4; q += blockDim.x) mine.Add(quads[q], 4 * q);
  } else {
    auto logit = [&](int i) { return i < V ? row[i] : -INFINITY; };
    for (int q = threadIdx.x; 4 * q < V; q += blockDim.x) {
      mine.Add(make_float4(logit(4 * q), logit(4 * q + 1), logit(4 * q + 2), logit(4 * q + 3)),
               4 * q);
    }
  }
  mine = WarpMerge(mine);
  __syncthreads();
  if (threadIdx.x % kWarp == 0) scratch[threadIdx.x / kWarp] = mine;
  __syncthreads();
  RowSummary total = RowSummary::Empty();
  if (threadIdx.x % kWarp < blockDim.x / kWarp) total = scratch[threadIdx.x % kWarp];
  return WarpMerge(total);
}

// The sum of v over the threads before this one (in thread order), and the block's total.
__device__ float BlockExclusiveScan(float v, float* scratch, float* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  float inclusive = v;
  for (int o = 1; o < kWarp; o *= 2) {
    const float before = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += before;
  }
  __syncthreads();
  if (lane == kWarp - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    float warp_total = lane < blockDim.x / kWarp ? scratch[lane] : 0.0f;
    for (int o = 1; o < kWarp; o *= 2) {
      const float before = __shfl_up_sync(0xffffffffu, warp_total, o);
      if (lane >= o) warp_total += before;
    }
    scratch[lane] = warp_total;  // Inclusive over warps.
  }
  __syncthreads();
  *total = scratch[blockDim.x / kWarp - 1];
  return (warp > 0 ? scratch[warp - 1] : 0.0f) + inclusive - v;
}

__device__ uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void SampleKernel(const float* logits, int V, const SamplingRow* rows, int32_t* ids,
                             float* logprobs) {
  __shared__ float scratch[kWarp];
  __shared__ int scratch_int[kWarp];
  __shared__ RowSummary scratch_summary[kWarp];
  WaitForPreviousKernel();
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * V;
  const SamplingRow p = rows[blockIdx.x];
  const RowSummary summary = SummarizeRow(row, V, scratch_summary);
  const float top = summary.top;
  const float log_sum = logf(summary.sum);
  // A row with no logit above −FLT_MAX (NaN or −∞ throughout: a broken model) has no first; it
  // takes id 0, as the CPU sampler does, so that nothing reads past the row or the embeddings.
  const int most_likely = summary.first < V ? summary.first : 0;

  int chosen;
  if (p.temperature == 0.0f || p.top_k == 1) {
    chosen = most_likely;
  } else {
    // Tempered scores s = (l − top)/T ≤ 0; a token is kept when s ≥ threshold.
    const float inv_t = 1.0f / p.temperature;
    auto score = [&](int i) { return (row[i] - top) * inv_t; };
    float min_score = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) min_score = fminf(min_score, score(i));
    min_score = -BlockMax(-min_score, scratch);
    float threshold = min_score;
    if (p.top_k > 0 && p.top_k < V) {
      float lo = min_score, hi = 0;  // count(s ≥ lo) ≥ k always.
      for (int step = 0; step < kBisectionSteps; ++step) {
        const float mid = 0.5f * (lo + hi);
        float count = 0;
        for (int i = threadIdx.x; i < V; i += blockDim.x) count += score(i) >= mid;
        if (BlockSum(count, scratch) >= p.top_k)
          lo = mid;
        else
          hi = mid;
      }
      threshold = fmaxf(threshold, lo);
    }
    if (p.min_p > 0) threshold = fmaxf(threshold, logf(p.min_p));
    auto mass_above = [&](float t) {
      float m = 0;
      for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float s = score(i);
        if (s >= t) m += expf(s);
      }
      return BlockSum(m, scratch);
    };
    if (p.top_p < 1.0f) {
      const float total = mass_above(threshold);
      float lo = threshold, hi = 0;  // mass(≥ lo) ≥ top_p · total always.
      for (int step = 0; step < kBisectionSteps; ++step) {
        const float mid = 0.5f * (lo + hi);
        if (mass_above(mid) >= p.top_p * total)
          lo = mid;
        else
          hi = mid;
      }
      threshold = lo;
    }
    // Draw: walk the kept tokens in id order; each thread owns a contiguous range of ids.
    const int per_thread = (V + blockDim.x - 1) / blockDim.x;
    const int begin = min(V, static_cast<int>(threadIdx.x) * per_thread);
    const int end = min(V, begin + per_thread);
    float mine = 0;
    for (int i = begin; i < end; ++i) {
      const float s = score(i);
      if (s >= threshold) mine += expf(s);
    }
    float kept_total;
    float running = BlockExclusiveScan(mine, scratch, &kept_total);
    const double u = static_cast<double>(Mix(Mix(p.seed) ^ p.step) >> 11) * 0x1.0p-53;
    const float target = static_cast<float>(u) * kept_total;
    int found = V;
    if (running <= target && target < running + mine) {
      for (int i = begin; i < end; ++i) {
        const float s = score(i);
        if (s < threshold) continue;
        running += expf(s);
        if (target < running) {
          found = i;
          break;
        }
      }
    }
    found = BlockMin(found, scratch_int);
    // Rounding can leave the target just past the last kept token: take the most likely one.
    chosen = found < V ? found : most_likely;
  }
  if (threadIdx.x == 0) {
    ids[blockIdx.x] = chosen;
    logprobs[blockIdx.x] = row[chosen] - top - log_sum;
  }
}

}  // namespace

cudaError_t SampleTokens(const float* logits, int rows, int V, const SamplingRow* params,
                         int32_t* ids, float* logprobs, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return Launch(SampleKernel, rows, kThreads, 0, stream, logits, V, params, ids, logprobs);
}

}  // namespace ttt::kernels::cuda
