// A decode step's layers for one sequence (batch 1, where a step's time is one user's latency) in
// one persistent kernel.
//
// At batch 1 a step streams the layers' weights (2.4 GB at 1b: 0.6 ms at the memory's rate), with
// small, latency-bound stages between the products: the pre-conv and the norms, the TTT step. As
// separate kernels, each stage waits for the one before it to drain and a product's stream starts
// only once its input is ready, so the memory idles for much of the step. Here one block an SM runs
// every layer:
// - a producer warp streams the block's share of each product's weight rows, in the order the
//   products use them, into a ring of shared-memory slots (cp.async.bulk, completing on
//   mbarriers), one copy in flight at a time. It waits for nothing but free slots and its last
//   copy, so the stream runs on through the stages between products and into the next layer;
// - the consumer warps do the stages. Each block makes a product's input row itself (a norm over a
//   few KB, cheaper than one more barrier), multiplies it into its slots' rows, a warp two rows
//   at a time, and writes their outputs; the TTT step runs a warp a head (DecodeLinearToken) on
//   the first blocks, as soon as every block has published its rows of the step's inputs, while
//   the other blocks multiply in_proj's gate rows.
// The stages meet at grid barriers; the launch is cooperative, so every block is resident.
//
// What crosses blocks (h, the projection, the TTT output, the feed-forward's activation) is
// written before a barrier and read after it; the sequence's state is read and written by one
// block each (a head's by its warp, the pre-conv's history by block 0).
//
// It is exact. Against the kernels per stage it is 8% faster at 1b and 12% slower at 125m
// (bench/README.md, v20–v21: 1.18 against 1.29 ms a token; 0.31 against 0.28), so the engine
// times both as it starts and keeps the faster (v20).
#include <algorithm>
#include <cuda/atomic>
#include <cuda/ptx>
#include <type_traits>

#include "kernels/cuda/grid_sync.cuh"
#include "kernels/cuda/ttt_decode.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kConsumerWarps = 7;
constexpr int kConsumerThreads = kConsumerWarps * kWarp;
constexpr int kThreads = kWarp + kConsumerThreads;  // Warp 0 is the producer.
constexpr int kConsumerBarrier = 1;                 // Named barrier 0 is __syncthreads'.
// A slot holds whole rows: eight of 2,048 bf16, two of the 1b model's down_proj (5,504).
constexpr int kSlotBytes = 32 * 1024;
constexpr int kMinSlots = 2, kMaxSlots = 6;
// Copies the producer has in flight at once. With one chunk an SM in flight the memory already
// streams at ~4.2 TB/s; more add little bandwidth, but every load of the stages and the grid
// barriers queues behind them (bench/README.md, v19: ttt-grid-sync's barrier takes 2.4 µs beside
// one chunk in flight an SM, 5.6 beside two, 14 beside four; a 1b step 1.18 ms with one, 1.23
// with two, 1.25 unbounded).
constexpr int kCopiesInFlight = 1;
constexpr int kBarrierBytes = 128;  // The slots' mbarriers, at the front of shared memory.
// SequenceStepArgs::counters: the grid barriers' arrivals, the blocks done with the step, and the
// blocks that have published the TTT step's inputs.
enum Counter { kBarrierArrivals, kBlocksDone, kTttInputsPublished };
static_assert(kTttInputsPublished + 1 == kSequenceStepCounters);
// A consumer thread's channel quads in the row stages: widths up to 4·kQuads·kConsumerThreads.
constexpr int kQuads = 4;
static_assert(2 * kMaxSlots * sizeof(uint64_t) <= kBarrierBytes);

// The products of a layer, in the order the step uses them. in_proj comes in two: the TTT step's
// inputs (q, k, v and the step sizes), then the gate, which the step does not read: the blocks
// that run no head multiply it while the heads' blocks run the step.
enum Product { kTttInputs, kGate, kOProj, kGateUp, kDown, kProducts };

// The rows of a product one block holds, [first, first + rows), and how they come through the
// ring: rows_per_chunk at a time (even for gate_up, whose gate and up rows come in pairs).
struct Share {
  const char* w;  // The block's first row.
  int in, first, rows, rows_per_chunk, row_bytes;
  bool pairs;
  __device__ int chunks() const { return (rows + rows_per_chunk - 1) / rows_per_chunk; }
};

// A product's rows [begin, end) are dealt to blocks first_block, first_block + 1, ... evenly.
template <typename T>
__device__ Share ShareOf(const SequenceStepArgs& a, const SequenceStepLayer& layer, int product) {
  const ProjectionColumns& columns = layer.ttt_inputs.columns;  // The gate's, if any, are last.
  const void* w = layer.down;
  int in = a.I, begin = 0, end = a.D, first_block = 0;
  if (product == kTttInputs) {
    w = layer.in_proj, in = a.D, end = columns.g >= 0 ? columns.g : columns.ld;
  }
  if (product == kGate) {
    w = layer.in_proj, in = a.D, first_block = layer.ttt.nh;
    begin = max(columns.g, 0), end = columns.g >= 0 ? columns.g + a.D : 0;
  }
  if (product == kOProj) w = layer.o_proj, in = a.D;
  if (product == kGateUp) w = layer.gate_up, in = a.D, end = 2 * a.I;
  Share s;
  s.pairs = product == kGateUp;
  const int blocks = gridDim.x - first_block, block = blockIdx.x - first_block;
  int per_block = (end - begin + blocks - 1) / blocks;
  if (s.pairs) per_block += per_block % 2;
  s.in = in;
  s.first = block < 0 ? end : min(end, begin + block * per_block);
  s.rows = block < 0 ? 0 : min(end, s.first + per_block) - s.first;
  s.row_bytes = in * static_cast<int>(sizeof(T));
  s.rows_per_chunk = kSlotBytes / s.row_bytes;
  if (s.pairs) s.rows_per_chunk -= s.rows_per_chunk % 2;
  s.w = static_cast<const char*>(w) + static_cast<int64_t>(s.first) * s.row_bytes;
  return s;
}

// The producer: every chunk of every layer's shares, in order; chunk i goes to slot i % slots
// once the consumers have freed that slot's previous chunk. The weights are read once a step,
// so they are marked first to leave L2, ahead of what the stages read there.
template <typename T>
__device__ void StreamWeights(const SequenceStepArgs& a, char* ring, int slots, uint64_t* full,
                              uint64_t* empty) {
  uint64_t evict_first;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(evict_first));
  int chunk = 0;
  for (int l = 0; l < a.num_layers; ++l) {
    for (int product = 0; product < kProducts; ++product) {
      const Share s = ShareOf<T>(a, a.layers[l], product);
      for (int row = 0; row < s.rows; row += s.rows_per_chunk, ++chunk) {
        const int slot = chunk % slots, round = chunk / slots;
        if (round > 0) WaitForPhase(&empty[slot], (round - 1) & 1);
        if (chunk >= kCopiesInFlight) {
          const int landed = chunk - kCopiesInFlight;
          WaitForPhase(&full[landed % slots], (landed / slots) & 1);
        }
        const uint32_t bytes = min(s.rows_per_chunk, s.rows - row) * s.row_bytes;
        ::cuda::ptx::mbarrier_arrive_expect_tx(::cuda::ptx::sem_release, ::cuda::ptx::scope_cta,
                                               ::cuda::ptx::space_shared, &full[slot], bytes);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;" ::"r"(
                static_cast<uint32_t>(__cvta_generic_to_shared(ring + slot * kSlotBytes))),
            "l"(s.w + static_cast<int64_t>(row) * s.row_bytes), "r"(bytes),
            "r"(static_cast<uint32_t>(__cvta_generic_to_shared(&full[slot]))), "l"(evict_first)
            : "memory");
      }
    }
  }
}

// The consumer warps' own barrier (the producer never joins it).
__device__ __forceinline__ void ConsumersSync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kConsumerBarrier), "n"(kConsumerThreads) : "memory");
}

// Sum over the consumer threads; every one gets it (scratch: kWarp floats).
__device__ float ConsumersSum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp - 1;
  v = WarpSum(v);
  ConsumersSync();
  if (lane == 0) scratch[warp] = v;
  ConsumersSync();
  return WarpSum(lane < kConsumerWarps ? scratch[lane] : 0.0f);
}

// The grid barrier of the consumer warps (the producer never waits at one), and its halves.
__device__ __forceinline__ void ConsumersGridBarrier(unsigned* arrivals, unsigned& expected) {
  GridBarrier(arrivals, expected, threadIdx.x == kWarp, [] { ConsumersSync(); });
}
__device__ __forceinline__ void ConsumersGridArrive(unsigned* arrivals, unsigned& expected) {
  GridArrive(arrivals, expected, threadIdx.x == kWarp, [] { ConsumersSync(); });
}
__device__ __forceinline__ void ConsumersGridWait(unsigned* arrivals, unsigned expected) {
  GridWait(arrivals, expected, threadIdx.x == kWarp, [] { ConsumersSync(); });
}

// The consumers' part of a product, chunk j of the block's share being the ring's chunk
// `first_chunk` + j, its input x in floats (laid out by XQuad). Rows go to warps in units of two
// (one where a chunk's rows are odd), the share's units dealt round-robin, so a warp multiplies
// whole rows and sums them within itself: no warp waits for another, and a warp may run ahead to
// the next chunks while others finish one. Every consumer thread waits for each chunk's fill and,
// once done with it, arrives on its empty barrier (kConsumerThreads arrivals), units there or not:
// - each thread's own arrival releases its own reads of the slot. With one arrival a warp after
//   __syncwarp, compute-sanitizer's racecheck saw the other lanes' reads race the refill's copy;
//   every lane arriving costs nothing measurable (bench/README.md, v21);
// - a slot is refilled only once every thread has passed its wait, so no parity wait can fall a
//   whole round behind its barrier and take the next phase for the one it waits on.
// `out(row, sum, next_row_sum)` gets a unit's sums: once for a pair (gate_up), else once a row.
template <typename T, typename Out>
__device__ void Multiply(const Share& s, const float* x, char* ring, int slots, uint64_t* full,
                         uint64_t* empty, int first_chunk, Out out) {
  constexpr int E = kElements<T>;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp - 1;
  const int vectors = s.in / E;
  const int unit_rows = s.rows_per_chunk % 2 == 0 ? 2 : 1;
  const int chunk_units = s.rows_per_chunk / unit_rows;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  int unit = warp;  // This warp's next unit, counted over the share.
  for (int j = 0; j < s.chunks(); ++j) {
    const int chunk = first_chunk + j, slot = chunk % slots;
    const int rows = min(s.rows_per_chunk, s.rows - j * s.rows_per_chunk);
    const int first_unit = j * chunk_units, units = (rows + unit_rows - 1) / unit_rows;
    WaitForPhase(&full[slot], (chunk / slots) & 1);
    for (; unit < first_unit + units; unit += kConsumerWarps) {
      const int r = unit * unit_rows - j * s.rows_per_chunk;  // The unit's row in the chunk.
      const bool two = unit_rows == 2 && r + 1 < rows;
      const uint4* w0 = reinterpret_cast<const uint4*>(ring + slot * kSlotBytes) + r * vectors;
      const uint4* w1 = two ? w0 + vectors : w0;
      // Two sums a row, even and odd elements, halve the chains of dependent fmas.
      float sum0[2] = {}, sum1[2] = {};
#pragma unroll 4
      for (int v = lane; v < vectors; v += kWarp) {
        float xf[E], wf0[E], wf1[E];
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
          const float4 x_quad = x4[q * vectors + v];
          xf[4 * q] = x_quad.x, xf[4 * q + 1] = x_quad.y;
          xf[4 * q + 2] = x_quad.z, xf[4 * q + 3] = x_quad.w;
        }
        Unpack(w0[v], wf0, static_cast<const T*>(nullptr));
        Unpack(w1[v], wf1, static_cast<const T*>(nullptr));
#pragma unroll
        for (int e = 0; e < E; ++e) {
          sum0[e % 2] = fmaf(xf[e], wf0[e], sum0[e % 2]);
          sum1[e % 2] = fmaf(xf[e], wf1[e], sum1[e % 2]);
        }
      }
      const float row0 = WarpSum(sum0[0] + sum0[1]), row1 = WarpSum(sum1[0] + sum1[1]);
      if (lane == 0) {
        const int row = s.first + j * s.rows_per_chunk + r;
        if (s.pairs) {
          out(row, row0, row1);
        } else {
          out(row, row0, 0.0f);
          if (two) out(row + 1, row1, 0.0f);
        }
      }
    }
    ::cuda::ptx::mbarrier_arrive(&empty[slot]);
  }
}

// A consumer thread's channel quads: c = 4·(t + m·kConsumerThreads), m < kQuads.
template <typename F>
__device__ __forceinline__ void ForEachQuad(int D, F f) {
  const int t = threadIdx.x - kWarp;
#pragma unroll
  for (int m = 0; m < kQuads; ++m) {
    const int c = 4 * (t + m * kConsumerThreads);
    if (c < D) f(m, c);
  }
}

// The pre-conv of channels c .. c + 3 from their normed inputs: conv(history ++ normed), the
// history's ring from row `oldest` on (DecodeTaps).
__device__ __forceinline__ float4 PreConvQuad(const float* history, int oldest, int D, int c,
                                              int ck, float4 normed, const float* w,
                                              const float* b) {
  float out[4];
  if (ck == kFourTaps) {
    Taps<4> taps[4];
    FourChannelDecodeTaps(history, oldest, D, c, normed, taps);
    FourChannelConv(taps, c, w, b, out);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const Taps<kMaxTaps> taps =
          DecodeTaps<kMaxTaps>(history, oldest, D, c + i, ck, Channel(normed, i));
      out[i] = ConvOf(taps, c + i, w, b, ck);
    }
  }
  return make_float4(out[0], out[1], out[2], out[3]);
}

// A product's input row holds, for each 16-byte vector v of a weight row, its E floats as E/4
// float4s kept `vectors` apart (all first quads, then all second ones), so that a warp's loads of
// either are contiguous rather than 32 bytes apart (a two-way bank conflict).
template <typename T>
__device__ __forceinline__ int XQuad(int c, int width) {
  constexpr int E = kElements<T>;
  return c % E / 4 * (width / E) + c / E;
}

// Channels c .. c + 3 of a product's input row of `width` channels.
template <typename T>
__device__ __forceinline__ void StoreQuad(float* x, int width, int c, float4 v) {
  reinterpret_cast<float4*>(x)[XQuad<T>(c, width)] = v;
}

// Asks L2 for what a layer's stages read besides the weight stream and the activations: its
// norms' and convs' parameters and the sequence's state at that layer (W1 included, which the
// TTT warps copy at the layer's start). Each block asks for its share of the lines.
__device__ void PrefetchLayer(const SequenceStepArgs& a, const SequenceStepLayer& layer,
                              const float* base, int first_thread, int threads) {
  const int D = a.D, ck = layer.ttt_inputs.conv.ck, nh = layer.ttt.nh, f = layer.ttt.f,
            K = layer.ttt.K;
  const TttStateOffsets& off = a.offsets;
  const struct {
    const void* p;
    int floats;
  } parts[] = {
      {layer.conv_norm, layer.conv_norm != nullptr ? D : 0},
      {layer.conv_w, layer.conv_norm != nullptr ? D * ck : 0},
      {layer.conv_b, layer.conv_norm != nullptr ? D : 0},
      {base + a.conv_history_offset, layer.conv_norm != nullptr ? D * (ck - 1) : 0},
      {layer.seq_norm, D},
      {layer.post_norm_w, D},
      {layer.post_norm_b, D},
      {layer.ffn_norm, D},
      {layer.ttt_inputs.conv.q_weight, layer.ttt_inputs.share_qk ? D * ck : 0},
      {layer.ttt_inputs.conv.k_weight, layer.ttt_inputs.share_qk ? D * ck : 0},
      {layer.ttt_inputs.conv.q_bias, layer.ttt_inputs.share_qk ? D : 0},
      {layer.ttt_inputs.conv.k_bias, layer.ttt_inputs.share_qk ? D : 0},
      {base + layer.ttt_inputs.conv.history_offset, layer.ttt_inputs.share_qk ? D * (ck - 1) : 0},
      {layer.ttt.ln_weight, D},
      {layer.ttt.ln_bias, D},
      {base + off.W1, off.w1_split ? nh * f * f / 2 : nh * f * f},  // What the TTT step reads.
      {base + off.b1, nh * f},
      {base + off.k, nh * K * f},
      {base + off.g1, nh * K * f},
      {base + off.lr, nh * K}};
  constexpr int kLineFloats = 32;
  const int stride = gridDim.x * threads;
  int line = blockIdx.x * threads + first_thread;
  for (const auto& part : parts) {
    const int lines = (part.floats + kLineFloats - 1) / kLineFloats;
    for (; line < lines; line += stride) {
      asm volatile(
          "prefetch.global.L2 [%0];" ::"l"(static_cast<const float*>(part.p) + line * kLineFloats));
    }
    line -= lines;
  }
}

// With bf16 weights the engine holds W1 in halves (TttStateOffsets::w1_split), with float32
// weights whole; SetUpSequenceStep refuses any other pairing.
template <typename T>
constexpr bool kW1Split = std::is_same_v<T, __nv_bfloat16>;

template <typename T, int kF, int kTaps, bool kSplit = kW1Split<T>>
__global__ void __launch_bounds__(kThreads, 1) SequenceStepKernel(SequenceStepArgs a, int slots) {
  extern __shared__ __align__(128) char shared[];
  __shared__ float scratch[kWarp];
  uint64_t* full = reinterpret_cast<uint64_t*>(shared);
  uint64_t* empty = full + kMaxSlots;
  char* ring = shared + kBarrierBytes;
  // A product's input row, in floats: the products' loops then unpack only the weights.
  float* x = reinterpret_cast<float*>(ring + slots * kSlotBytes);
  float* resid = reinterpret_cast<float*>(x + max(a.D, a.I));  // This block's copy of h.
  float* normed = resid + a.D;  // The pre-conv's normed row, for the history.
  float4* w1 = reinterpret_cast<float4*>(normed + a.D);  // DecodeSharedBytes(kF)

  const Segment seg = *a.segment;
  if (seg.count == 0) return;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      ::cuda::ptx::mbarrier_init(&full[s], 1);
      ::cuda::ptx::mbarrier_init(&empty[s], kConsumerThreads);
    }
    ::cuda::ptx::fence_mbarrier_init(::cuda::ptx::sem_release, ::cuda::ptx::scope_cluster);
  }
  __syncthreads();
  if (threadIdx.x < kWarp) {
    if (threadIdx.x == 0) StreamWeights<T>(a, ring, slots, full, empty);
    return;
  }

  const int t = threadIdx.x - kWarp, warp = t / kWarp;
  const int D = a.D, I = a.I;
  float* sequence_state = a.states + static_cast<size_t>(seg.slot) * a.slot_floats;
  unsigned expected = 0, inputs_expected = 0;
  int chunk = 0;
  auto multiply = [&](const Share& s, auto out) {
    Multiply<T>(s, x, ring, slots, full, empty, chunk, out);
    chunk += s.chunks();
  };
  PrefetchLayer(a, a.layers[0], sequence_state + a.layers[0].state_offset, t, kConsumerThreads);
  for (int l = 0; l < a.num_layers; ++l) {
    const SequenceStepLayer& layer = a.layers[l];
    float* base = sequence_state + layer.state_offset;
    const int nh = layer.ttt.nh;
    // Each product's share is read from the layer table at the start of the stage before it, so
    // that those loads overlap the stage's own.
    const Share ttt_inputs = ShareOf<T>(a, layer, kTttInputs);
    // The block's head's W1 (its state is this block's alone) comes while the stages before run.
    if (warp == 0) {
      if (blockIdx.x < nh) {
        const bool commits = WindowPosition(seg, layer.ttt.K) == layer.ttt.K - 1;
        CopyW1Async<kF, kSplit>(base, a.offsets, nh, blockIdx.x, commits, w1);
      }
      __pipeline_commit();
    }

    // The pre-conv (h += CausalConv(RMSNorm(h))) and the sequence norm: in_proj's input.
    const float4* h4 = reinterpret_cast<const float4*>(a.h);
    float4 v[kQuads];
    float squares = 0;
    ForEachQuad(D, [&](int m, int c) {
      v[m] = __ldcg(h4 + c / 4);
      squares += Dot4(v[m], v[m]);
    });
    const bool pre_conv = layer.conv_norm != nullptr;
    if (pre_conv) {
      const float inv_rms = rsqrtf(ConsumersSum(squares, scratch) / D + a.rms_eps);
      const float* history = base + a.conv_history_offset;
      const int ck = layer.ttt_inputs.conv.ck;
      const int oldest = ck > 1 ? HistoryRow(seg.start, ck - 1) : 0;
      squares = 0;
      ForEachQuad(D, [&](int m, int c) {
        const float4 n = (inv_rms * v[m]) * Load4(layer.conv_norm + c);
        *reinterpret_cast<float4*>(normed + c) = n;
        v[m] = v[m] + PreConvQuad(history, oldest, D, c, ck, n, layer.conv_w, layer.conv_b);
        squares += Dot4(v[m], v[m]);
      });
    }
    const float inv_rms = rsqrtf(ConsumersSum(squares, scratch) / D + a.rms_eps);
    ForEachQuad(D, [&](int m, int c) {
      *reinterpret_cast<float4*>(resid + c) = v[m];
      StoreQuad<T>(x, D, c, (inv_rms * v[m]) * Load4(layer.seq_norm + c));
    });
    ConsumersSync();
    multiply(ttt_inputs, [&](int row, float sum, float) { a.proj[row] = sum; });
    // The TTT step's inputs are published (every block's, on a counter of their own), and only
    // the heads' blocks wait for them. The others multiply the gate meanwhile.
    const Share gate_rows = ShareOf<T>(a, layer, kGate);
    ConsumersGridArrive(&a.counters[kTttInputsPublished], inputs_expected);
    if (blockIdx.x < nh) {
      // The window's earlier rows are state, not the step's: the TTT warp has them on their way
      // before it waits for the inputs.
      WindowRows<kF> rows;
      if (warp == 0) {
        const int r = WindowPosition(seg, layer.ttt.K);
        const DecodeWindow window = WindowOf<kF>(layer.ttt, blockIdx.x, base, a.offsets);
        LoadWindowRows<kF, WindowPart::kKeys>(window, r, rows);
        LoadWindowRows<kF, WindowPart::kGradients>(window, r, rows);
      }
      ConsumersGridWait(&a.counters[kTttInputsPublished], inputs_expected);
      // The TTT step, a head a block (nh < gridDim.x). Meanwhile the other warps ask L2 for the
      // next layer's parameters and state, and block 0's write the token's row of the pre-conv's
      // history (every block has read the row it replaces, having published its TTT inputs).
      if (warp == 0) {
        TttProjectionInputs inputs = layer.ttt_inputs;
        inputs.proj = a.proj;
        DecodeLinearToken<kF, kTaps, kSplit, /*kRowsLoaded=*/true>(
            layer.ttt, inputs, seg, blockIdx.x, base, a.offsets, w1, a.ttt_out, rows,
            /*commit=*/[](const DecodeWindow&, float4) {},
            /*release=*/[] {});
      } else if (pre_conv && blockIdx.x == 0) {
        const int ck = layer.ttt_inputs.conv.ck;
        if (ck > 1) {
          float* row = base + a.conv_history_offset + HistoryRow(seg.start, ck - 1) * D;
          for (int c = t - kWarp; c < D; c += kConsumerThreads - kWarp) row[c] = normed[c];
        }
      }
    } else {
      multiply(gate_rows, [&](int row, float sum, float) { a.proj[row] = sum; });
    }
    if (warp != 0 && l + 1 < a.num_layers) {
      PrefetchLayer(a, a.layers[l + 1], sequence_state + a.layers[l + 1].state_offset, t - kWarp,
                    kConsumerThreads - kWarp);
    }
    // A window's last token commits θ0 with every warp of the head's block: by one warp alone it
    // made a 1b step's p99 ~0.2 ms longer than its median.
    if (blockIdx.x < nh && WindowPosition(seg, layer.ttt.K) == layer.ttt.K - 1) {
      ConsumersSync();  // The window's last keys and gradients are visible to every warp.
      const DecodeWindow window = WindowOf<kF>(layer.ttt, blockIdx.x, base, a.offsets);
      CommitWindow<kF, kSplit>(layer.ttt, window, w1, LaneBias<kF>(window), warp, kConsumerWarps);
    }
    ConsumersGridBarrier(&a.counters[kBarrierArrivals], expected);

    // o_proj of LayerNorm(TTT output) · gelu(gate), added into h.
    const Share o_proj = ShareOf<T>(a, layer, kOProj);
    const float4* out4 = reinterpret_cast<const float4*>(a.ttt_out);
    const int g = layer.ttt_inputs.columns.g;
    float4 gate[kQuads];
    float sum = 0;
    ForEachQuad(D, [&](int m, int c) {
      v[m] = __ldcg(out4 + c / 4);
      if (g >= 0) gate[m] = __ldcg(reinterpret_cast<const float4*>(a.proj + g + c));
      sum += Sum4(v[m]);
    });
    const float mean = ConsumersSum(sum, scratch) / D;
    squares = 0;
    ForEachQuad(D, [&](int m, int c) {
      v[m] = v[m] - Broadcast4(mean);
      squares += Dot4(v[m], v[m]);
    });
    const float scale = rsqrtf(ConsumersSum(squares, scratch) / D + a.ln_eps);
    ForEachQuad(D, [&](int m, int c) {
      float4 y = (scale * v[m]) * Load4(layer.post_norm_w + c) + Load4(layer.post_norm_b + c);
      if (g >= 0) {
        y = make_float4(Gelu(gate[m].x) * y.x, Gelu(gate[m].y) * y.y, Gelu(gate[m].z) * y.z,
                        Gelu(gate[m].w) * y.w);
      }
      StoreQuad<T>(x, D, c, y);
    });
    ConsumersSync();
    multiply(o_proj, [&](int row, float sum, float) { a.h[row] = resid[row] + sum; });
    ConsumersGridBarrier(&a.counters[kBarrierArrivals], expected);

    // The feed-forward: SwiGLU of gate_up(RMSNorm(h)), then down, added into h.
    const Share gate_up = ShareOf<T>(a, layer, kGateUp);
    squares = 0;
    ForEachQuad(D, [&](int m, int c) {
      v[m] = __ldcg(h4 + c / 4);
      squares += Dot4(v[m], v[m]);
    });
    const float ffn_inv_rms = rsqrtf(ConsumersSum(squares, scratch) / D + a.rms_eps);
    ForEachQuad(D, [&](int m, int c) {
      *reinterpret_cast<float4*>(resid + c) = v[m];
      StoreQuad<T>(x, D, c, (ffn_inv_rms * v[m]) * Load4(layer.ffn_norm + c));
    });
    ConsumersSync();
    multiply(gate_up, [&](int row, float gate_sum, float up_sum) {
      StoreAs(static_cast<T*>(a.act), row / 2, Swish(gate_sum, up_sum));
    });
    ConsumersGridBarrier(&a.counters[kBarrierArrivals], expected);
    const Share down = ShareOf<T>(a, layer, kDown);
    const uint4* act = static_cast<const uint4*>(a.act);
    for (int i = t; i < I / kElements<T>; i += kConsumerThreads) {
      float f[kElements<T>];
      Unpack(__ldcg(act + i), f, static_cast<const T*>(nullptr));
#pragma unroll
      for (int q = 0; q < kElements<T> / 4; ++q) {
        StoreQuad<T>(x, I, i * kElements<T> + 4 * q,
                     make_float4(f[4 * q], f[4 * q + 1], f[4 * q + 2], f[4 * q + 3]));
      }
    }
    ConsumersSync();
    multiply(down, [&](int row, float sum, float) { a.h[row] = resid[row] + sum; });
    if (l + 1 < a.num_layers) ConsumersGridBarrier(&a.counters[kBarrierArrivals], expected);
  }

  // The last block out leaves the counters at zero for the next step. Every block counted has
  // passed its last barrier, so none still waits on a counter.
  ConsumersSync();
  if (threadIdx.x == kWarp) {
    ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device> done(a.counters[kBlocksDone]);
    if (done.fetch_add(1, ::cuda::memory_order_acq_rel) == gridDim.x - 1) {
      ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device>(a.counters[kBarrierArrivals])
          .store(0);
      ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device>(a.counters[kTttInputsPublished])
          .store(0);
      done.store(0);
    }
  }
}

size_t ElementBytes(ElementType type) {
  return type == ElementType::kBFloat16 ? sizeof(__nv_bfloat16) : sizeof(float);
}

// Shared memory besides the slots: barriers, the input row (floats), h and the normed row, a
// head's W1.
size_t FixedSharedBytes(const SequenceStepArgs& a, int f) {
  return kBarrierBytes + sizeof(float) * std::max(a.D, a.I) + 2 * sizeof(float) * a.D +
         DecodeSharedBytes(f);
}

struct Device {
  int sms = 0, shared_optin = 0, cooperative = 0;
};

cudaError_t CurrentDevice(Device* d) {
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&d->sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (status == cudaSuccess) {
    status =
        cudaDeviceGetAttribute(&d->shared_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&d->cooperative, cudaDevAttrCooperativeLaunch, device);
  }
  return status;
}

// The dynamic shared memory a block may ask for: the device's limit less the kernel's static
// part (a few hundred bytes; this allows for a kilobyte).
size_t DynamicSharedLimit(const Device& d) {
  constexpr size_t kStaticAllowance = 1024;
  return static_cast<size_t>(d.shared_optin) - kStaticAllowance;
}

// The slots that fit beside the fixed part.
int SlotsFor(const SequenceStepArgs& a, int f, const Device& d) {
  const size_t fixed = FixedSharedBytes(a, f);
  if (DynamicSharedLimit(d) < fixed) return 0;
  return static_cast<int>(
      std::min<size_t>(kMaxSlots, (DynamicSharedLimit(d) - fixed) / kSlotBytes));
}

// The kernel's form for the weights' type, the heads' width and the TTT step's form.
template <typename T, int kF>
const void* KernelFor(bool four_taps) {
  return four_taps ? reinterpret_cast<const void*>(SequenceStepKernel<T, kF, kFourTaps>)
                   : reinterpret_cast<const void*>(SequenceStepKernel<T, kF, kMaxTaps>);
}

template <typename T>
const void* KernelFor(int f, bool four_taps) {
  switch (f) {
    case 16:
      return KernelFor<T, 16>(four_taps);
    case 32:
      return KernelFor<T, 32>(four_taps);
    default:
      return KernelFor<T, 64>(four_taps);
  }
}

const void* KernelFor(const SequenceStepArgs& a, ElementType type, bool four_taps) {
  return type == ElementType::kBFloat16 ? KernelFor<__nv_bfloat16>(a.f, four_taps)
                                        : KernelFor<float>(a.f, four_taps);
}

}  // namespace

bool SetUpSequenceStep(const SequenceStepArgs& a, const SequenceStepLayer& layer,
                       ElementType type) {
  Device d;
  if (CurrentDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const int vector = 16 / static_cast<int>(ElementBytes(type));
  const size_t row_bytes = ElementBytes(type) * std::max(2 * a.D, a.I);  // gate_up's in pairs.
  const StateAddress state{a.states, a.slot_floats, layer.state_offset};
  const bool weights_aligned = Aligned16(layer.in_proj) && Aligned16(layer.o_proj) &&
                               Aligned16(layer.gate_up) && Aligned16(layer.down);
  const bool rows_aligned =
      Aligned16(layer.seq_norm) && Aligned16(layer.post_norm_w) && Aligned16(layer.post_norm_b) &&
      Aligned16(layer.ffn_norm) &&
      (layer.ttt_inputs.columns.g < 0 || layer.ttt_inputs.columns.g % 4 == 0) &&
      (layer.conv_norm == nullptr ||
       (Aligned16(layer.conv_norm) && Aligned16(layer.conv_w) && Aligned16(layer.conv_b) &&
        a.conv_history_offset % 4 == 0 && a.slot_floats % 4 == 0 && layer.state_offset % 4 == 0));
  const bool fits =
      d.cooperative != 0 && a.D % vector == 0 && a.I % vector == 0 &&
      a.D <= 4 * kQuads * kConsumerThreads && row_bytes <= kSlotBytes && weights_aligned &&
      rows_aligned && TttDecodeFits(layer.ttt, layer.ttt_inputs, state, a.offsets) &&
      layer.ttt.f == a.f && layer.ttt.nh < d.sms && layer.ttt_inputs.conv.ck <= kMaxTaps &&
      a.offsets.w1_split == (type == ElementType::kBFloat16) && SlotsFor(a, a.f, d) >= kMinSlots;
  if (!fits) return false;
  TttProjectionInputs inputs = layer.ttt_inputs;
  inputs.proj = a.proj;
  const void* kernel = KernelFor(a, type, FourChannelLoadsFit(inputs));
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(DynamicSharedLimit(d))) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

cudaError_t SequenceStep(const SequenceStepArgs& a, const SequenceStepLayer& layer,
                         ElementType type, cudaStream_t stream) {
  Device d;
  if (const cudaError_t status = CurrentDevice(&d); status != cudaSuccess) return status;
  const int slots = SlotsFor(a, a.f, d);
  if (slots < kMinSlots) return cudaErrorNotSupported;
  if (!Aligned16(a.h) || !Aligned16(a.ttt_out) || !Aligned16(a.act) || !Aligned16(a.proj)) {
    return cudaErrorInvalidValue;
  }
  TttProjectionInputs inputs = layer.ttt_inputs;
  inputs.proj = a.proj;
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = d.sms;
  config.blockDim = kThreads;
  config.dynamicSmemBytes = FixedSharedBytes(a, a.f) + static_cast<size_t>(slots) * kSlotBytes;
  config.stream = stream;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  SequenceStepArgs args = a;
  void* params[] = {&args, const_cast<int*>(&slots)};
  return cudaLaunchKernelExC(&config, KernelFor(a, type, FourChannelLoadsFit(inputs)), params);
}

}  // namespace ttt::kernels::cuda
