// Whether a decode step's two kinds of work overlap inside one persistent kernel: the TTT step's
// state stream (memory: each (sequence, head) reads its W1 and window and writes a row) and the
// dense products (tensor cores, each weight read from L2 by every group of rows after the first).
// v12 and v15 found that as kernels on separate streams they take turns rather than overlap; this
// asks whether blocks taking tasks from one queue, each waiting only for its own inputs, do
// better. A synthetic step with a preset's shapes and bytes at batch 256, in groups of 16, 32 or
// 64 sequences; a layer is a chain of five kinds of task for each group:
//   in_proj        tiles of y [rows, 64 outputs] = x [rows, in] · w [64, in]ᵀ (bf16, float32 sums,
//                  mma.sync), outputs 3 × hidden + heads (q, v, the gate and the step sizes);
//   state          a warp per (sequence, head), eight a task: 24 KB read, 2 KB written (a head's
//                  state at f = 64: W1, the window, the conv history);
//   o_proj, gate_up, down  tiles as in_proj's, of hidden, 2 × intermediate and hidden outputs.
// Each task of a group waits for all tasks of the kind before it in the chain (the rows it reads
// are whole only then; the row stages between the products are left out), counted as SequenceStep
// counts. The queue's orders:
//   state_only, products_only  each side alone (no waits);
//   in_turn       each kind for every group, then the next kind: the engine's kernels one after
//                 another, less their launch gaps;
//   pipelined     a wavefront: group g runs the chain's task c while group g + 1 runs task c - 1,
//                 so that blocks waiting for one group's inputs find other groups' work queued.
// Prints one JSON line per (preset, group size, order): µs a layer (median of 11 launches), the
// state and weight bytes a step moves and their GB/s at that time; then, per preset, the largest
// error of the last layer's gate_up and down against double sums. Exits 1 if an error is past
// float32's reach.
//   ttt-overlap [125m|1b ...]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda/atomic>
#include <string>
#include <vector>

#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "server/util/percentile.h"

namespace {

using ttt::Median;

constexpr int kWarp = 32, kWarps = 8, kThreads = kWarps * kWarp;
constexpr int kBatch = 256, kMaxGroups = kBatch / 16;
// A (sequence, head)'s state in float4s: read, then a row written.
constexpr int kReadPieces = 24 * 1024 / 16, kWritePieces = 2 * 1024 / 16;
constexpr int kTileOut = kWarps * 8;  // A product tile: a warp a block of 8 outputs.
// x comes into shared memory kChunk columns at a time. Its rows lie 320 bytes apart (≡ 64 mod 128),
// so the 16-byte reads of two rows by eight lanes fall on all 32 banks.
constexpr int kChunk = 128, kChunkPitch = kChunk + 32;

// A layer's chain, in order.
enum Kind : int { kInProj, kState, kOProj, kGateUp, kDown, kKinds };
constexpr const char* kKindNames[] = {"in_proj", "state", "o_proj", "gate_up", "down"};
enum class Order { kStateOnly, kProductsOnly, kInTurn, kPipelined };
constexpr const char* kOrderNames[] = {"state_only", "products_only", "in_turn", "pipelined"};

struct Preset {
  const char* name;
  int hidden, intermediate, heads, layers;
};
constexpr Preset kPresets[] = {{"125m", 768, 2048, 12, 12}, {"1b", 2048, 5504, 32, 24}};

struct Task {
  int kind, layer, group, index;  // index: which of the (kind, layer, group)'s tasks.
};

struct Args {
  const Task* tasks;
  int num_tasks, layers, heads, group_rows;
  bool wait_for_inputs;
  int tasks_of[kKinds];                 // Tasks a group has of each kind in a layer.
  int outputs[kKinds], inputs[kKinds];  // Each product's shape (state: unused).
  size_t weight_offset[kKinds], layer_weights, y_offset[kKinds];
  int x_pitch;
  unsigned* next_task;
  unsigned* done;  // Tasks finished, by [kind][layer][group].
  const float4* state;
  float4* state_rows;
  const __nv_bfloat16* x;  // [kBatch][x_pitch]: every product's input, its first K columns.
  const __nv_bfloat16* w;  // [layers][the products' w [N][K] in turn]
  float* y;                // Each product's [kBatch][N], over the last layer's.
};

__device__ unsigned* Done(const Args& a, int kind, int layer, int group) {
  return &a.done[(kind * a.layers + layer) * kMaxGroups + group];
}

// Eight items of a group, a warp each: the item's state read and summed, a row of it written.
__device__ void StateTask(const Args& a, const Task& t, int warp, int lane) {
  const int item = t.index * kWarps + warp;
  const int sequence = t.group * a.group_rows + item / a.heads, head = item % a.heads;
  const size_t at = (static_cast<size_t>(sequence) * a.layers + t.layer) * a.heads + head;
  const float4* in = a.state + at * kReadPieces;
  float sum = 0.0f;
#pragma unroll 8
  for (int i = lane; i < kReadPieces; i += kWarp) {
    const float4 v = in[i];
    sum += (v.x + v.y) + (v.z + v.w);
  }
  float4* out = a.state_rows + at * kWritePieces;
  for (int i = lane; i < kWritePieces; i += kWarp) out[i] = make_float4(sum, 0.0f, 0.0f, 0.0f);
}

// d += a·b, one m16n8k16 product of bf16 pairs into float32 sums.
__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A tile of a group's product: y [kRows, the 64 outputs from index · 64], a warp a block of 8.
// Lane (g, q) = (lane / 4, lane % 4) loads 16 bytes of its weight row g at k = kb + 8q for each
// 32 columns kb, and the same 16 bytes of x's rows; two mmas take them as their k = 2q, 2q + 1,
// 2q + 8, 2q + 9 (the fragments' order), one the first 8 bytes and one the last. A's and B's k
// orders agree, so the sums are the product's.
template <int kRows>
__device__ void ProductTask(const Args& a, const Task& t, __nv_bfloat16* xs, int warp, int lane) {
  constexpr int kSteps = kChunk / 32, kPieces = kChunk / 8, kRowTiles = kRows / 16;
  const int out = a.outputs[t.kind], in = a.inputs[t.kind];
  const int g = lane / 4, q = lane % 4, n0 = t.index * kTileOut + warp * 8;
  const __nv_bfloat16* w_row = a.w + t.layer * a.layer_weights + a.weight_offset[t.kind] +
                               static_cast<size_t>(n0 + g) * in + 8 * q;
  const __nv_bfloat16* x = a.x + static_cast<size_t>(t.group) * kRows * a.x_pitch;
  float sums[kRowTiles][4] = {};
  for (int kc = 0; kc < in; kc += kChunk) {
    uint4 b[kSteps];  // Requested before the block's sync, so they come while x's chunk does.
#pragma unroll
    for (int s = 0; s < kSteps; ++s) b[s] = *reinterpret_cast<const uint4*>(w_row + kc + 32 * s);
    __syncthreads();  // Every warp is done with the chunk before.
    for (int i = threadIdx.x; i < kRows * kPieces; i += kThreads) {
      const int row = i / kPieces, piece = i % kPieces;
      *reinterpret_cast<uint4*>(xs + row * kChunkPitch + 8 * piece) =
          *reinterpret_cast<const uint4*>(x + row * a.x_pitch + kc + 8 * piece);
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
#pragma unroll
      for (int m = 0; m < kRowTiles; ++m) {
        const __nv_bfloat16* rows = xs + (16 * m + g) * kChunkPitch + 32 * s + 8 * q;
        const uint4 x0 = *reinterpret_cast<const uint4*>(rows);
        const uint4 x1 = *reinterpret_cast<const uint4*>(rows + 8 * kChunkPitch);
        Mma(sums[m], x0.x, x1.x, x0.y, x1.y, b[s].x, b[s].y);
        Mma(sums[m], x0.z, x1.z, x0.w, x1.w, b[s].z, b[s].w);
      }
    }
  }
  float* y = a.y + a.y_offset[t.kind] + static_cast<size_t>(t.group) * kRows * out + n0 + 2 * q;
#pragma unroll
  for (int m = 0; m < kRowTiles; ++m) {
    const int row = 16 * m + g;
    *reinterpret_cast<float2*>(y + row * out) = make_float2(sums[m][0], sums[m][1]);
    *reinterpret_cast<float2*>(y + (row + 8) * out) = make_float2(sums[m][2], sums[m][3]);
  }
}

__device__ void WaitFor(unsigned* counter, unsigned expected) {
  ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device> count(*counter);
  while (count.load(::cuda::memory_order_acquire) < expected) {
  }
}

// Each block takes the queue's next task, waits for its inputs, runs it and counts it done.
// Every task's inputs come from tasks earlier in the queue, and every block is resident (a
// cooperative launch), so the waits end.
template <int kRows>
__global__ void __launch_bounds__(kThreads) RunQueue(Args a) {
  extern __shared__ __align__(16) __nv_bfloat16 xs[];
  __shared__ int taken;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (;;) {
    if (threadIdx.x == 0) taken = static_cast<int>(atomicAdd(a.next_task, 1u));
    __syncthreads();
    if (taken >= a.num_tasks) return;
    const Task t = a.tasks[taken];
    if (a.wait_for_inputs && threadIdx.x == 0) {
      if (t.kind > 0) {
        WaitFor(Done(a, t.kind - 1, t.layer, t.group), a.tasks_of[t.kind - 1]);
      } else if (t.layer > 0) {
        WaitFor(Done(a, kKinds - 1, t.layer - 1, t.group), a.tasks_of[kKinds - 1]);
      }
    }
    __syncthreads();
    if (t.kind == kState) {
      StateTask(a, t, warp, lane);
    } else {
      ProductTask<kRows>(a, t, xs, warp, lane);
    }
    __syncthreads();  // The task's writes, and every thread's read of `taken`, come before.
    if (threadIdx.x == 0) {
      ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device>(*Done(a, t.kind, t.layer, t.group))
          .fetch_add(1, ::cuda::memory_order_release);
    }
  }
}

std::vector<Task> Queue(Order order, const Args& a) {
  const int groups = kBatch / a.group_rows;
  std::vector<Task> tasks;
  auto add = [&](int kind, int layer, int group) {
    for (int i = 0; i < a.tasks_of[kind]; ++i) tasks.push_back({kind, layer, group, i});
  };
  // Task c of a group's step is kind c % kKinds of layer c / kKinds.
  const int chain = a.layers * kKinds;
  for (int c = 0; order != Order::kPipelined && c < chain; ++c) {
    const int kind = c % kKinds, layer = c / kKinds;
    const bool state = kind == kState;
    if ((order == Order::kStateOnly && !state) || (order == Order::kProductsOnly && state)) {
      continue;
    }
    for (int g = 0; g < groups; ++g) add(kind, layer, g);
  }
  for (int wave = 0; order == Order::kPipelined && wave < chain + groups - 1; ++wave) {
    for (int g = 0; g < groups; ++g) {
      const int c = wave - g;
      if (c >= 0 && c < chain) add(c % kKinds, c / kKinds, g);
    }
  }
  return tasks;
}

// The queue's kernel for groups of kRows, with its shared memory and the blocks that fit at once.
struct Runner {
  const void* kernel;
  size_t shared_bytes;
  int blocks;
};

template <int kRows>
Runner RunnerFor(int sms) {
  const auto kernel = RunQueue<kRows>;
  const size_t shared_bytes = kRows * kChunkPitch * sizeof(__nv_bfloat16);
  int per_sm = 0;
  CHECK_CUDA(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, shared_bytes));
  return {reinterpret_cast<const void*>(kernel), shared_bytes, sms * per_sm};
}

float Launch(const Args& a, const Runner& runner, unsigned* counters, size_t counter_bytes) {
  CHECK_CUDA(cudaMemset(counters, 0, counter_bytes));
  Args copy = a;
  void* args[] = {&copy};
  return EventTimer().Ms([&] {
    CHECK_CUDA(cudaLaunchCooperativeKernel(runner.kernel, runner.blocks, kThreads, args,
                                           runner.shared_bytes));
  });
}

// Values in [-1, 1) from a hash of their index (splitmix64): a 1b step's 1.2 billion weights
// in seconds, where a generator drawing them in turn takes a minute.
std::vector<__nv_bfloat16> RandomBf16(size_t count, uint64_t seed) {
  std::vector<__nv_bfloat16> out(count);
  for (size_t i = 0; i < count; ++i) {
    uint64_t z = seed * 0x9e3779b97f4a7c15ull + i;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    out[i] = __float2bfloat16(static_cast<float>(z >> 40) * 0x1p-23f - 1.0f);
  }
  return out;
}

// The largest |y − x·wᵀ| over every seventh output of the last layer's product `kind` (seven is
// prime to the eight outputs a warp holds, so every lane's outputs are among them).
double WorstError(const Args& a, int kind, const std::vector<__nv_bfloat16>& x,
                  const std::vector<__nv_bfloat16>& w, double* largest) {
  const int out = a.outputs[kind], in = a.inputs[kind];
  std::vector<float> y(static_cast<size_t>(kBatch) * out);
  CHECK_CUDA(cudaMemcpy(y.data(), a.y + a.y_offset[kind], y.size() * sizeof(float),
                        cudaMemcpyDeviceToHost));
  const __nv_bfloat16* w_kind = w.data() + (a.layers - 1) * a.layer_weights + a.weight_offset[kind];
  double worst = 0;
  for (int r = 0; r < kBatch; ++r) {
    for (int n = 0; n < out; n += 7) {
      double sum = 0;
      for (int k = 0; k < in; ++k) {
        sum += static_cast<double>(__bfloat162float(x[static_cast<size_t>(r) * a.x_pitch + k])) *
               __bfloat162float(w_kind[static_cast<size_t>(n) * in + k]);
      }
      worst = std::max(worst, std::abs(sum - y[static_cast<size_t>(r) * out + n]));
      *largest = std::max(*largest, std::abs(sum));
    }
  }
  return worst;
}

// Runs every group size and order at one preset's shapes; returns whether the products were right.
bool Measure(const Preset& preset, const cudaDeviceProp& prop) {
  Args a{};
  a.layers = preset.layers;
  a.heads = preset.heads;
  const auto round_up = [](int n) { return (n + kTileOut - 1) / kTileOut * kTileOut; };
  const int outputs[kKinds] = {round_up(3 * preset.hidden + preset.heads), 0, preset.hidden,
                               2 * preset.intermediate, preset.hidden};
  const int inputs[kKinds] = {preset.hidden, 0, preset.hidden, preset.hidden, preset.intermediate};
  size_t weights = 0, y_count = 0;
  for (int kind = 0; kind < kKinds; ++kind) {
    a.outputs[kind] = outputs[kind];
    a.inputs[kind] = inputs[kind];
    a.tasks_of[kind] = outputs[kind] / kTileOut;  // The state's, by group size below.
    a.weight_offset[kind] = weights;
    a.y_offset[kind] = y_count;
    weights += static_cast<size_t>(outputs[kind]) * inputs[kind];
    y_count += static_cast<size_t>(kBatch) * outputs[kind];
  }
  a.layer_weights = weights;
  a.x_pitch = preset.intermediate;
  const size_t items = static_cast<size_t>(kBatch) * preset.layers * preset.heads;
  const double state_bytes = static_cast<double>(items) * (kReadPieces + kWritePieces) * 16;
  const double weight_bytes = 2.0 * preset.layers * weights;
  const size_t counter_bytes = (1 + kKinds * preset.layers * kMaxGroups) * sizeof(unsigned);

  unsigned* counters = nullptr;
  float4 *state = nullptr, *state_rows = nullptr;
  __nv_bfloat16 *x = nullptr, *w = nullptr;
  float* y = nullptr;
  const size_t x_count = static_cast<size_t>(kBatch) * a.x_pitch;
  const size_t w_count = preset.layers * weights;
  CHECK_CUDA(cudaMalloc(&counters, counter_bytes));
  CHECK_CUDA(cudaMalloc(&state, items * kReadPieces * sizeof(float4)));
  CHECK_CUDA(cudaMalloc(&state_rows, items * kWritePieces * sizeof(float4)));
  CHECK_CUDA(cudaMalloc(&x, x_count * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&w, w_count * sizeof(__nv_bfloat16)));
  CHECK_CUDA(cudaMalloc(&y, y_count * sizeof(float)));
  CHECK_CUDA(cudaMemset(state, 0, items * kReadPieces * sizeof(float4)));
  const std::vector<__nv_bfloat16> x_host = RandomBf16(x_count, 1);
  const std::vector<__nv_bfloat16> w_host = RandomBf16(w_count, 2);
  CHECK_CUDA(cudaMemcpy(x, x_host.data(), x_count * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(w, w_host.data(), w_count * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
  a.next_task = counters;
  a.done = counters + 1;
  a.state = state;
  a.state_rows = state_rows;
  a.x = x;
  a.w = w;
  a.y = y;

  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const Runner runners[] = {RunnerFor<16>(sms), RunnerFor<32>(sms), RunnerFor<64>(sms)};
  for (int r = 0; r < 3; ++r) {
    a.group_rows = 16 << r;
    a.tasks_of[kState] = a.group_rows * preset.heads / kWarps;
    for (const Order order :
         {Order::kStateOnly, Order::kProductsOnly, Order::kInTurn, Order::kPipelined}) {
      const std::vector<Task> queue = Queue(order, a);
      Task* tasks = nullptr;
      CHECK_CUDA(cudaMalloc(&tasks, queue.size() * sizeof(Task)));
      CHECK_CUDA(
          cudaMemcpy(tasks, queue.data(), queue.size() * sizeof(Task), cudaMemcpyHostToDevice));
      a.tasks = tasks;
      a.num_tasks = static_cast<int>(queue.size());
      a.wait_for_inputs = order == Order::kInTurn || order == Order::kPipelined;
      Launch(a, runners[r], counters, counter_bytes);  // Warm-up.
      std::vector<float> ms;
      for (int i = 0; i < 11; ++i) ms.push_back(Launch(a, runners[r], counters, counter_bytes));
      const double seconds = 1e-3 * Median(ms);
      const double state_read = order == Order::kProductsOnly ? 0 : state_bytes;
      const double weights_read = order == Order::kStateOnly ? 0 : weight_bytes;
      std::printf(
          "{\"gpu\":\"%s\",\"preset\":\"%s\",\"order\":\"%s\",\"layers\":%d,\"blocks\":%d,"
          "\"batch\":%d,\"group_rows\":%d,\"us_per_layer\":%.2f,\"state_bytes\":%.0f,"
          "\"weight_bytes\":%.0f,\"gb_per_s\":%.0f}\n",
          prop.name, preset.name, kOrderNames[static_cast<int>(order)], preset.layers,
          runners[r].blocks, kBatch, a.group_rows, 1e6 * seconds / preset.layers, state_read,
          weights_read, 1e-9 * (state_read + weights_read) / seconds);
      CHECK_CUDA(cudaFree(tasks));
    }
  }

  bool right = true;
  for (const int kind : {kGateUp, kDown}) {
    double largest = 0;
    const double worst = WorstError(a, kind, x_host, w_host, &largest);
    std::printf(
        "{\"gpu\":\"%s\",\"preset\":\"%s\",\"check\":\"%s\",\"max_abs_error\":%.3g,"
        "\"largest\":%.3g}\n",
        prop.name, preset.name, kKindNames[kind], worst, largest);
    right = right && worst <= 1e-4 * largest;
  }
  for (void* p :
       {static_cast<void*>(counters), static_cast<void*>(state), static_cast<void*>(state_rows),
        static_cast<void*>(x), static_cast<void*>(w), static_cast<void*>(y)}) {
    CHECK_CUDA(cudaFree(p));
  }
  return right;
}

}  // namespace

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  bool right = true;
  for (const Preset& preset : kPresets) {
    bool asked = argc == 1;
    for (int i = 1; i < argc; ++i) asked = asked || std::strcmp(argv[i], preset.name) == 0;
    if (asked) right = Measure(preset, prop) && right;
  }
  return right ? 0 : 1;
}
