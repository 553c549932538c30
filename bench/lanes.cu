// Whether a decode step at batch 256 could overlap its two kinds of work by splitting the batch
// into two lanes, each a stream whose kernels keep to part of the GPU. The TTT step streams every
// (sequence, head)'s state from memory; the dense products are short chains of tensor-core
// kernels bound by their latency more than by bytes. Run one after the other (the engine now),
// a layer costs the sum. Kernels on separate streams took turns rather than overlapped (v12, v15)
// because each filled every SM; here each kernel is held to a share of the SMs: the state kernel
// by its grid (a block of 1,024 threads an SM, kept alone there by its shared memory), cuBLASLt's
// products by CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET. A synthetic step with a preset's shapes
// and bytes, captured in a CUDA graph, all layers:
//   state        each (sequence, head) reads 24 KB and writes 2 KB (a head's W1, window and conv
//                history at f = 64, and a row), a warp an item;
//   products     in_proj, o_proj (added into its output), gate_up, down (added), bf16 weights
//                and inputs, float32 outputs, as the engine plans them: all four cuBLASLt's
//                ("lt"), or as the engine takes them at 64–256 rows ("ours": in_proj on
//                cu::TensorCoreProduct, o_proj with the norm and gate_up with SwiGLU on
//                cu::FeedForwardEntry, down on cuBLASLt). Each of our kernels' blocks takes more
//                than half an SM's shared memory, so it holds to the SMs its grid fills;
//   serial       a layer's state, then its products, on one stream: the engine's order;
//   lanes        half the sequences each: lane A a layer's state then its products, lane B its
//                products then its state, so each lane's state streams while the other's
//                products run;
//   lanes_held   the same with each state kernel replaced by one that holds its SMs for as
//                long as the half's state took alone and moves no bytes.
// Halves ("_half") run alone as well, each on its share of SMs. The row kernels between the
// products (the engine's PreConvDecode and PostNormGate) are left out of both forms.
// Prints one JSON line per (preset, products, case, SM shares): µs a layer, median of 15 graph
// launches. "ours" runs where the GPU runs sm_90a code and the preset is one the engine takes
// them at (125m).
//   ttt-lanes [125m|1b ...]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "bench/cublaslt_plan.h"
#include "bench/cuda_check.h"
#include "bench/event_timer.h"
#include "kernels/cuda_ops.h"
#include "server/util/percentile.h"

namespace {

using ttt::Median;
namespace cu = ttt::kernels::cuda;
using bf16 = __nv_bfloat16;

constexpr int kBatch = 256, kHalf = kBatch / 2;
constexpr int kWarp = 32, kStateThreads = 1024, kStateWarps = kStateThreads / kWarp;
constexpr int kReadPieces = 24 * 1024 / 16, kWritePieces = 2 * 1024 / 16;  // float4s an item.
// More than half of an SM's shared memory, so that no other block of this kernel or of
// cuBLASLt's (~200 KB) shares its SM: the grid is the SMs it takes.
constexpr size_t kStateSharedBytes = 116 * 1024;

struct Preset {
  const char* name;
  int hidden, intermediate, heads, layers;
};
constexpr Preset kPresets[] = {{"125m", 768, 2048, 12, 12}, {"1b", 2048, 5504, 32, 24}};
// The widest model the engine takes our products for (CudaEngine::kTensorCoreProductsMaxWidth).
constexpr int kOurProductsMaxWidth = 1024;

enum class ProductKernels { kCublasLt, kOurs };

// Items [first, first + count) of a layer: (sequence, head) pairs, a warp each, grid-strided.
__global__ void __launch_bounds__(kStateThreads)
    StreamState(const float4* state, float4* rows, int first, int count, int heads, int layers,
                int layer) {
  const int lane = threadIdx.x % kWarp;
  const int warps = gridDim.x * kStateWarps;
  for (int i = blockIdx.x * kStateWarps + threadIdx.x / kWarp; i < count; i += warps) {
    const int item = first + i, sequence = item / heads, head = item % heads;
    const size_t at = (static_cast<size_t>(sequence) * layers + layer) * heads + head;
    const float4* in = state + at * kReadPieces;
    float sum = 0.0f;
#pragma unroll 8
    for (int p = lane; p < kReadPieces; p += kWarp) {
      const float4 v = in[p];
      sum += (v.x + v.y) + (v.z + v.w);
    }
    for (int p = lane; p < kWritePieces; p += kWarp) {
      rows[at * kWritePieces + p] = make_float4(sum, 0.0f, 0.0f, 0.0f);
    }
  }
}

// Holds its SMs as StreamState does, for `nanoseconds`, moving no bytes: whether lanes that do
// not overlap are held back by what the two kinds of work share (memory) or by where their
// blocks run.
__global__ void __launch_bounds__(kStateThreads) HoldSms(long long nanoseconds) {
  auto now = [] {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  };
  const long long start = now();
  while (now() - start < nanoseconds) {
  }
}

// in_proj, o_proj, gate_up, down: o_proj and down add into their outputs (the residual).
constexpr bool kAddsToOutput[4] = {false, true, false, true};

struct Step {
  const Preset& preset;
  cublasLtHandle_t handle;
  size_t workspace_bytes;
  void* workspace[2];  // A lane each: two products running at once may not share one.
  const float4* state;
  float4* rows;
  const bf16* weights;  // [layers][in_proj, o_proj, gate_up, down]
  size_t layer_weights;
  const bf16* x;  // [kBatch][intermediate]: every product's input.
  float* y;       // [kBatch][widest output]
  int product_in[4], product_out[4];
  size_t weight_offset[4];
  // Our products' buffers: the residual rows h (down adds into them too), the norm's input,
  // the rows' sums of squares by o_proj's column tiles, the activation.
  float* h;               // [kBatch][hidden]
  bf16* normed;           // [kBatch][hidden]
  float* row_squares;     // [square tiles][kBatch]
  bf16* activation;       // [kBatch][intermediate]
  const float* ffn_norm;  // [hidden]

  // The state kernel for sequences [first, first + count) on `blocks` SMs.
  void State(int layer, int first, int count, int blocks, cudaStream_t stream) const {
    const int heads = preset.heads;
    StreamState<<<blocks, kStateThreads, kStateSharedBytes, stream>>>(
        state, rows, first * heads, count * heads, heads, preset.layers, layer);
    CHECK_CUDA(cudaGetLastError());
  }

  // What State(…, count, blocks, …) costs in time alone, `us` µs, with no memory traffic.
  void Hold(float us, int blocks, cudaStream_t stream) const {
    HoldSms<<<blocks, kStateThreads, kStateSharedBytes, stream>>>(
        static_cast<long long>(us * 1e3f));
    CHECK_CUDA(cudaGetLastError());
  }

  // A layer's four products for rows [first, first + plans' rows), with the given plans.
  void Products(int layer, int first, const std::vector<LtPlan>& plans, int lane,
                cudaStream_t stream) const {
    for (int p = 0; p < 4; ++p) {
      const float alpha = 1.0f, beta = kAddsToOutput[p] ? 1.0f : 0.0f;
      const bf16* w = weights + layer * layer_weights + weight_offset[p];
      const bf16* xs = x + static_cast<size_t>(first) * product_in[p];
      float* ys = y + static_cast<size_t>(first) * product_out[p];
      CHECK_CUBLAS(cublasLtMatmul(handle, plans[p].desc, &alpha, w, plans[p].w, xs, plans[p].x,
                                  &beta, ys, plans[p].y, ys, plans[p].y, &plans[p].algo,
                                  workspace[lane], workspace_bytes, stream));
    }
  }

  // The same four products as the engine takes them at 64–256 rows, for rows [first, first +
  // rows); `down` is cuBLASLt's plan for the last.
  void OurProducts(int layer, int first, int rows, const LtPlan& down, int lane,
                   cudaStream_t stream) const {
    const int H = preset.hidden, I = preset.intermediate;
    const bf16* w = weights + layer * layer_weights;
    const bf16* rows_in = x + static_cast<size_t>(first) * H;
    CHECK_CUDA(cu::TensorCoreProduct(rows_in, rows, H, w + weight_offset[0], product_out[0],
                                     y + static_cast<size_t>(first) * product_out[0],
                                     product_out[0], stream));
    const cu::FeedForwardEntry entry{.D = H,
                                     .I = I,
                                     .eps = 1e-6f,
                                     .o_proj = w + weight_offset[1],
                                     .gate_up = w + weight_offset[2],
                                     .ffn_norm_weight = ffn_norm,
                                     .post_norm_rows = rows_in,
                                     .h = h + static_cast<size_t>(first) * H,
                                     .normed = normed + static_cast<size_t>(first) * H,
                                     .row_squares = row_squares + first,
                                     .row_stride = kBatch,
                                     .activation = activation + static_cast<size_t>(first) * I};
    CHECK_CUDA(entry.Run(rows, stream));
    const float alpha = 1.0f, beta = 1.0f;
    const bf16* act = activation + static_cast<size_t>(first) * I;
    float* hs = h + static_cast<size_t>(first) * H;
    CHECK_CUBLAS(cublasLtMatmul(handle, down.desc, &alpha, w + weight_offset[3], down.w, act,
                                down.x, &beta, hs, down.y, hs, down.y, &down.algo, workspace[lane],
                                workspace_bytes, stream));
  }

  void Run(ProductKernels kind, int layer, int first, int rows, const std::vector<LtPlan>& plans,
           int lane, cudaStream_t stream) const {
    if (kind == ProductKernels::kOurs) {
      OurProducts(layer, first, rows, plans[3], lane, stream);
    } else {
      Products(layer, first, plans, lane, stream);
    }
  }

  std::vector<LtPlan> Plans(int rows, int product_sms) const {
    std::vector<LtPlan> plans;
    for (int p = 0; p < 4; ++p) {
      plans.push_back(
          PlanLt(handle, rows, product_in[p], product_out[p], workspace_bytes, product_sms));
    }
    return plans;
  }
};

// The median µs a layer of 15 launches of the graph that `enqueue` captures on two streams
// (the second forked from the first and joined back).
float TimeGraph(const Step& step, cudaStream_t a, cudaStream_t b,
                const std::function<void()>& enqueue) {
  cudaEvent_t fork, join;
  for (cudaEvent_t* e : {&fork, &join}) CHECK_CUDA(cudaEventCreate(e));
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(a, cudaStreamCaptureModeThreadLocal));
  CHECK_CUDA(cudaEventRecord(fork, a));
  CHECK_CUDA(cudaStreamWaitEvent(b, fork));
  enqueue();
  CHECK_CUDA(cudaEventRecord(join, b));
  CHECK_CUDA(cudaStreamWaitEvent(a, join));
  CHECK_CUDA(cudaStreamEndCapture(a, &graph));
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  EventTimer timer;
  std::vector<float> times;
  for (int run = 0; run < 17; ++run) {
    const float ms = timer.Ms([&] { CHECK_CUDA(cudaGraphLaunch(exec, a)); }, a);
    if (run >= 2) times.push_back(ms);  // The first two warm the graph up.
  }
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  for (cudaEvent_t e : {fork, join}) CHECK_CUDA(cudaEventDestroy(e));
  return 1000.0f * Median(times) / step.preset.layers;
}

void Print(const char* gpu, const Preset& preset, const char* products, const char* name,
           int state_sms, int product_sms, float us) {
  std::printf(
      "{\"gpu\":\"%s\",\"preset\":\"%s\",\"products\":\"%s\",\"case\":\"%s\","
      "\"batch\":%d,\"state_sms\":%d,\"product_sms\":%d,\"us_per_layer\":%.2f}\n",
      gpu, preset.name, products, name, kBatch, state_sms, product_sms, us);
  std::fflush(stdout);
}

void Run(const Preset& preset, const cudaDeviceProp& device, cublasLtHandle_t handle) {
  const int H = preset.hidden, I = preset.intermediate, L = preset.layers,
            sms = device.multiProcessorCount;
  // in_proj's width padded to 64, as the engine lays it out.
  const int in_proj_out = (3 * H + preset.heads + 63) / 64 * 64;
  const int in[4] = {H, H, H, I}, out[4] = {in_proj_out, H, 2 * I, H};
  size_t layer_weights = 0, offsets[4];
  for (int p = 0; p < 4; ++p) {
    offsets[p] = layer_weights;
    layer_weights += static_cast<size_t>(in[p]) * out[p];
  }
  const size_t items = static_cast<size_t>(kBatch) * L * preset.heads;
  float4 *state, *rows;
  bf16 *weights, *x;
  float *y, *h, *row_squares, *ffn_norm;
  bf16 *normed, *activation;
  void* workspace[2];
  const size_t workspace_bytes = size_t{32} << 20;
  const size_t square_tiles = cu::FeedForwardEntry::SquareTiles(H);
  CHECK_CUDA(cudaMalloc(&state, items * kReadPieces * sizeof(float4)));
  CHECK_CUDA(cudaMalloc(&rows, items * kWritePieces * sizeof(float4)));
  CHECK_CUDA(cudaMalloc(&weights, L * layer_weights * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&x, static_cast<size_t>(kBatch) * I * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&y, static_cast<size_t>(kBatch) * 2 * I * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&h, static_cast<size_t>(kBatch) * H * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&row_squares, square_tiles * kBatch * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&ffn_norm, H * sizeof(float)));
  CHECK_CUDA(cudaMalloc(&normed, static_cast<size_t>(kBatch) * H * sizeof(bf16)));
  CHECK_CUDA(cudaMalloc(&activation, static_cast<size_t>(kBatch) * I * sizeof(bf16)));
  for (void*& w : workspace) CHECK_CUDA(cudaMalloc(&w, workspace_bytes));
  // Small finite values (bf16 0x3c3c is ~0.011): only time is measured.
  CHECK_CUDA(cudaMemset(state, 0, items * kReadPieces * sizeof(float4)));
  CHECK_CUDA(cudaMemset(weights, 0x3c, L * layer_weights * sizeof(bf16)));
  CHECK_CUDA(cudaMemset(x, 0x3c, static_cast<size_t>(kBatch) * I * sizeof(bf16)));
  CHECK_CUDA(cudaMemset(y, 0, static_cast<size_t>(kBatch) * 2 * I * sizeof(float)));
  CHECK_CUDA(cudaMemset(h, 0, static_cast<size_t>(kBatch) * H * sizeof(float)));
  CHECK_CUDA(cudaMemset(ffn_norm, 0, H * sizeof(float)));

  Step step{preset,
            handle,
            workspace_bytes,
            {workspace[0], workspace[1]},
            state,
            rows,
            weights,
            layer_weights,
            x,
            y,
            {},
            {},
            {},
            h,
            normed,
            row_squares,
            activation,
            ffn_norm};
  for (int p = 0; p < 4; ++p) {
    step.product_in[p] = in[p];
    step.product_out[p] = out[p];
    step.weight_offset[p] = offsets[p];
  }
  cudaStream_t a, b;
  CHECK_CUDA(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));

  // Times one case: `layer(l)` enqueues layer l's work, for every layer, in one graph.
  auto measure = [&](const char* products, const char* name, int state_sms, int product_sms,
                     auto layer) {
    const float us = TimeGraph(step, a, b, [&] {
      for (int l = 0; l < L; ++l) layer(l);
    });
    Print(device.name, preset, products, name, state_sms, product_sms, us);
    return us;
  };
  measure("", "state", sms, 0, [&](int l) { step.State(l, 0, kBatch, sms, a); });
  std::vector<std::pair<ProductKernels, const char*>> kinds = {{ProductKernels::kCublasLt, "lt"}};
  if (H <= kOurProductsMaxWidth && cu::TensorCoreProductsAvailable(H, I)) {
    kinds.emplace_back(ProductKernels::kOurs, "ours");
  }
  for (const auto& kind_and_name : kinds) {
    const ProductKernels kind = kind_and_name.first;
    const char* products = kind_and_name.second;
    const std::vector<LtPlan> whole = step.Plans(kBatch, 0);
    measure(products, "products", 0, sms,
            [&](int l) { step.Run(kind, l, 0, kBatch, whole, 0, a); });
    measure(products, "serial", sms, sms, [&](int l) {
      step.State(l, 0, kBatch, sms, a);
      step.Run(kind, l, 0, kBatch, whole, 0, a);
    });
    for (const int state_sms : {sms / 4, sms / 3, sms / 2}) {
      const int product_sms = sms - state_sms;
      const std::vector<LtPlan> half = step.Plans(kHalf, product_sms);
      const float state_us = measure(products, "state_half", state_sms, 0,
                                     [&](int l) { step.State(l, 0, kHalf, state_sms, a); });
      measure(products, "products_half", 0, product_sms,
              [&](int l) { step.Run(kind, l, 0, kHalf, half, 0, a); });
      measure(products, "lanes", state_sms, product_sms, [&](int l) {
        step.State(l, 0, kHalf, state_sms, a);
        step.Run(kind, l, 0, kHalf, half, 0, a);
        step.Run(kind, l, kHalf, kHalf, half, 1, b);
        step.State(l, kHalf, kHalf, state_sms, b);
      });
      measure(products, "lanes_held", state_sms, product_sms, [&](int l) {
        step.Hold(state_us, state_sms, a);
        step.Run(kind, l, 0, kHalf, half, 0, a);
        step.Run(kind, l, kHalf, kHalf, half, 1, b);
        step.Hold(state_us, state_sms, b);
      });
      for (const LtPlan& plan : half) DestroyLt(plan);
    }
    for (const LtPlan& plan : whole) DestroyLt(plan);
  }
  CHECK_CUDA(cudaStreamDestroy(a));
  CHECK_CUDA(cudaStreamDestroy(b));
  for (void* w : workspace) CHECK_CUDA(cudaFree(w));
  for (void* p : {static_cast<void*>(state), static_cast<void*>(rows), static_cast<void*>(weights),
                  static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(h),
                  static_cast<void*>(row_squares), static_cast<void*>(ffn_norm),
                  static_cast<void*>(normed), static_cast<void*>(activation)}) {
    CHECK_CUDA(cudaFree(p));
  }
}

}  // namespace

int main(int argc, char** argv) {
  cudaDeviceProp device;
  CHECK_CUDA(cudaGetDeviceProperties(&device, 0));
  for (const void* kernel :
       {reinterpret_cast<const void*>(StreamState), reinterpret_cast<const void*>(HoldSms)}) {
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    kStateSharedBytes));
  }
  cublasLtHandle_t handle;
  CHECK_CUBLAS(cublasLtCreate(&handle));
  for (const Preset& preset : kPresets) {
    bool chosen = argc == 1;
    for (int i = 1; i < argc; ++i) chosen |= std::strcmp(argv[i], preset.name) == 0;
    if (chosen) Run(preset, device, handle);
  }
  cublasLtDestroy(handle);
  return 0;
}
