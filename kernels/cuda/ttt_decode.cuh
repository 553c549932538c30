// The decode step of TTT-Linear for one (sequence, head) item, one token, done by one warp with
// no barrier but its own: the batched decode kernel (ttt_scan.cu, a warp an item) and the
// one-sequence step kernel (sequence_step.cu) both run it. The token's inputs come from the
// fused projection (the q/k convs with their histories, RoPE and the step size, as
// PrepareTttInputs computes them).
//
// The warp covers a [rows, f] matrix in 16-byte pieces: lane (row group ro, column group cg) holds
// columns 4·cg .. 4·cg + 3 of rows ro, ro + R, ro + 2R, ... (R = 128 / f rows at once), so each
// warp-wide access reads R whole rows. Sums over columns are shuffles within a row group
// (ColumnSum); sums over rows are shuffles across them (RowGroupSum).
//
// θ0's W1 is read from shared memory, where the caller has it copied with cp.async (all of it in
// flight at once, no registers held); the window's pending keys and gradients are loaded into
// registers, and their q·k_j products taken, while it is in flight. At a window's last token θ0
// is committed from that copy. Where W1 is split in halves (TttStateOffsets::w1_split, the kSplit
// forms), the copy is of its upper half: 8 of a head's 16 KB at f = 64.
#pragma once

#include <cuda_pipeline.h>

#include <type_traits>

#include "kernels/cuda/ttt_inputs.cuh"

namespace ttt::kernels::cuda {

// Windows of up to this many tokens (16 in every known model; others: the general kernel).
constexpr int kDecodeMaxWindow = 16;
// The decode step comes in two forms: for q/k convs of exactly four taps (every known model) or
// none, reading four adjacent channels with each 16-byte load; and for any conv up to kMaxTaps,
// a channel a load.
constexpr int kFourTaps = 4;

template <int kF>
struct DecodeTile {
  static constexpr int kLanesPerRow = kF / 4;
  static constexpr int kRowsAtOnce = kWarp / kLanesPerRow;  // R
  static_assert(kRowsAtOnce * kF == 128, "R rows are 128 columns: 256 bytes of a plane of halves");
  static constexpr int kRowsPerLane = kF / kRowsAtOnce;     // Of θ0's f rows.
  static constexpr int kWindowRowsPerLane = (kDecodeMaxWindow + kRowsAtOnce - 1) / kRowsAtOnce;
};

template <int kF>
__device__ __forceinline__ float ColumnSum(float v) {
  for (int offset = 1; offset < DecodeTile<kF>::kLanesPerRow; offset *= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <int kF>
__device__ __forceinline__ float RowGroupSum(float v) {
  for (int offset = DecodeTile<kF>::kLanesPerRow; offset < kWarp; offset *= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// LayerNorm over the f columns of a row held four columns a lane: returns x − mean, and 1/σ.
template <int kF>
__device__ __forceinline__ float4 CentreColumns(float4 x, float eps, float* inv_std) {
  const float4 centred = x - Broadcast4(ColumnSum<kF>(Sum4(x)) / kF);
  *inv_std = rsqrtf(ColumnSum<kF>(Dot4(centred, centred)) / kF + eps);
  return centred;
}

// W1 in halves (TttStateOffsets::w1_split; server/engine/state_layout.h, SplitW1): a layer's
// [nh, f, f] as the upper 16 bits of every float, then the lower 16 bits. Four adjacent columns
// take a uint2 of each half (column c in the low 16 bits of its word).
__device__ __forceinline__ float4 JoinHalves(uint2 upper, uint2 lower) {
  return make_float4(__uint_as_float(upper.x << 16 | (lower.x & 0xffffu)),
                     __uint_as_float((upper.x & 0xffff0000u) | lower.x >> 16),
                     __uint_as_float(upper.y << 16 | (lower.y & 0xffffu)),
                     __uint_as_float((upper.y & 0xffff0000u) | lower.y >> 16));
}

__device__ __forceinline__ void SplitHalves(float4 w, uint2* upper, uint2* lower) {
  const uint32_t x = __float_as_uint(w.x), y = __float_as_uint(w.y), z = __float_as_uint(w.z),
                 v = __float_as_uint(w.w);
  *upper = make_uint2(x >> 16 | (y & 0xffff0000u), z >> 16 | (v & 0xffff0000u));
  *lower = make_uint2((x & 0xffffu) | y << 16, (z & 0xffffu) | v << 16);
}

__device__ __forceinline__ float JoinHalves(uint32_t upper, uint32_t lower) {
  return __uint_as_float(upper << 16 | lower);
}

__device__ __forceinline__ void SplitHalves(float w, uint16_t* upper, uint16_t* lower) {
  const uint32_t bits = __float_as_uint(w);
  *upper = static_cast<uint16_t>(bits >> 16);
  *lower = static_cast<uint16_t>(bits);
}

// The values the upper halves alone stand for: each float cut to bf16 leaves an interval one bf16
// step wide, and its middle is within half a step of the float, as rounding to bf16 would be.
// Each float is one byte permute: the half's two bytes above kMiddle's (bytes 4 and 5 of the
// pair); masking and or-ing took two instructions for every odd column.
__device__ __forceinline__ float4 UpperHalvesMiddle(uint2 upper) {
  constexpr uint32_t kMiddle = 0x8000u;
  constexpr uint32_t kLowHalf = 0x1054, kHighHalf = 0x3254;
  return make_float4(__uint_as_float(__byte_perm(upper.x, kMiddle, kLowHalf)),
                     __uint_as_float(__byte_perm(upper.x, kMiddle, kHighHalf)),
                     __uint_as_float(__byte_perm(upper.y, kMiddle, kLowHalf)),
                     __uint_as_float(__byte_perm(upper.y, kMiddle, kHighHalf)));
}

// The shared memory an item's warp works in: θ0's W1 [f, f] (whole, or its upper halves then its
// lower halves), then q and k [f] each.
inline size_t DecodeSharedBytes(int f) { return sizeof(float) * (f * f + 2 * f); }

// Where DecodeLinearToken keeps row d of q and k: by row group, (d mod R)·(f / R) + d / R, so that
// the rows a lane multiplies W1's by (ro, ro + R, ...) lie side by side and come four a load, not
// one (bench/README.md v60).
template <int kF>
__device__ __forceinline__ int ByRowGroup(int d) {
  using Tile = DecodeTile<kF>;
  return d % Tile::kRowsAtOnce * Tile::kRowsPerLane + d / Tile::kRowsAtOnce;
}

__device__ __forceinline__ float RowOf(float4 rows, int i) { return Channel(rows, i); }
__device__ __forceinline__ float RowOf(float row, int) { return row; }

// Whether the loads of DecodeLinearToken's kFourTaps form land on 16-byte boundaries.
inline bool FourChannelLoadsFit(const TttProjectionInputs& in) {
  const ProjectionColumns& c = in.columns;
  const bool projection = Aligned16(in.proj) && c.ld % 4 == 0 && c.q % 4 == 0 && c.v % 4 == 0 &&
                          (in.share_qk || c.k % 4 == 0);
  const QkConv& conv = in.conv;
  return projection && (!in.share_qk || (conv.ck == kFourTaps && conv.history_offset % 4 == 0 &&
                                         Aligned16(conv.q_weight) && Aligned16(conv.q_bias) &&
                                         Aligned16(conv.k_weight) && Aligned16(conv.k_bias)));
}

// Starts copying head `head`'s W1 of the state at `base` (a sequence's layer, nh heads) into w1,
// without committing the copy: all of it, or where W1 is split its upper halves, and its lower
// halves too if the token `commits` θ0 (a commit then reads nothing but shared memory, as with W1
// whole).
template <int kF, bool kSplit>
__device__ __forceinline__ void CopyW1Async(const float* base, const TttStateOffsets& off, int nh,
                                            int head, bool commits, float4* w1) {
  constexpr int kHalf = kF * kF / 8;  // 16-byte pieces in half of a head's W1 bytes.
  static_assert(kHalf % kWarp == 0, "a lane copies whole rounds of pieces");
  const int lane = threadIdx.x % kWarp;
  const float4* W1 = reinterpret_cast<const float4*>(base + off.W1) + lane;
  // `pieces` pieces a kWarp apart, from one address and constant offsets: a loop over the pieces
  // recomputed a 64-bit address for each.
  auto copy = [&](float4* to, const float4* from, auto pieces) {
#pragma unroll
    for (int i = 0; i < decltype(pieces)::value; i += kWarp) {
      __pipeline_memcpy_async(&to[i], &from[i], 16);
    }
  };
  using Half = std::integral_constant<int, kHalf>;
  if constexpr (kSplit) {
    copy(w1 + lane, W1 + head * kHalf, Half{});
    if (commits) copy(w1 + kHalf + lane, W1 + (nh + head) * kHalf, Half{});
  } else {
    copy(w1 + lane, W1 + head * 2 * kHalf, std::integral_constant<int, 2 * kHalf>{});
  }
}

// Where a head's window lives in its layer state: θ0 (W1 whole, or its halves four columns a
// uint2; b1) and the window's rows of keys, gradients and step sizes.
struct DecodeWindow {
  float4* W1;
  uint2* W1_upper;
  uint2* W1_lower;
  float4* b1;
  float4* k;
  float4* g1;
  float* lr;
};

template <int kF>
__device__ __forceinline__ DecodeWindow WindowOf(const TttScanParams& p, int head, float* base,
                                                 const TttStateOffsets& off) {
  constexpr int L = DecodeTile<kF>::kLanesPerRow;
  uint2* upper = reinterpret_cast<uint2*>(base + off.W1) + head * kF * L;
  return {reinterpret_cast<float4*>(base + off.W1) + head * kF * L,
          upper,
          upper + p.nh * kF * L,
          reinterpret_cast<float4*>(base + off.b1) + head * L,
          reinterpret_cast<float4*>(base + off.k) + head * p.K * L,
          reinterpret_cast<float4*>(base + off.g1) + head * p.K * L,
          base + off.lr + head * p.K};
}

// Row d's four columns of this lane (column group cg) of the W1 copied by CopyW1Async, as the
// decode step reads them.
template <int kF, bool kSplit>
__device__ __forceinline__ float4 CopiedW1(const float4* w1, int d, int cg) {
  constexpr int L = DecodeTile<kF>::kLanesPerRow;
  if constexpr (kSplit) {
    return UpperHalvesMiddle(reinterpret_cast<const uint2*>(w1)[d * L + cg]);
  } else {
    return w1[d * L + cg];
  }
}

// This lane's channels of b1 as DecodeLinearToken's tile deals them, which CommitWindow takes.
template <int kF>
__device__ __forceinline__ float4 LaneBias(const DecodeWindow& window) {
  const int lane = threadIdx.x % kWarp;
  return window.b1[lane % DecodeTile<kF>::kLanesPerRow];
}

// After a window's last token θ0 becomes θ̄ (spec §4): W1 −= Σ_j τ·lr_j·k_jᵀ g_j and
// b1 −= Σ_j τ·lr_j·g_j, from the copy of W1 in shared memory (its halves joined, where W1 is
// split) and `bias`, the lane's channels of b1 (LaneBias). Its rows may be
// shared by `warps` warps (this one `warp` of them, each lane taking every warps-th of its rows;
// warp 0 b1), which must see the window's last row of keys and gradients. Each lane loads, half
// the window's rows at a time and all of those at once, the gradients and step sizes of its
// columns and one column of the keys (lane l: l, l + 32, ...); a row's keys then come by
// shuffles. Loaded where they were used, the keys made the commit a chain of round trips to L2
// (bench/README.md v36).
template <int kF, bool kSplit>
__device__ __forceinline__ void CommitWindow(const TttScanParams& p, const DecodeWindow& window,
                                             float4* w1, float4 bias, int warp, int warps) {
  using Tile = DecodeTile<kF>;
  constexpr int L = Tile::kLanesPerRow, R = Tile::kRowsAtOnce;
  const int K = p.K, lane = threadIdx.x % kWarp, cg = lane % L, ro = lane / L;
  const float4* pg = window.g1;
  const float* plr = window.lr;
  const float* key_rows = reinterpret_cast<const float*>(window.k);
  const float tau_last = p.tau[K - 1];
  // The window's rows in two parts, to hold half of them in registers at once: each part
  // subtracts its rows from W1 in the shared copy, in the order one pass would.
  constexpr int kPart = kDecodeMaxWindow / 2;
  constexpr int kKeySlots = (kF + kWarp - 1) / kWarp;
  float4 bias_update = Broadcast4(0.0f);
#pragma unroll 1
  for (int part = 0; part < 2; ++part) {
    const int first = part * kPart;
    float keys[kPart][kKeySlots];
    float4 scaled[kPart];
#pragma unroll
    for (int i = 0; i < kPart; ++i) {
      const int j = first + i;
#pragma unroll
      for (int slot = 0; slot < kKeySlots; ++slot) {
        const int c = lane + kWarp * slot;
        keys[i][slot] = j < K && c < kF ? key_rows[j * kF + c] : 0.0f;
      }
      scaled[i] = j < K ? (tau_last * plr[j]) * pg[j * L + cg] : Broadcast4(0.0f);
      bias_update = bias_update + scaled[i];
    }
#pragma unroll 4
    for (int m = warp; m < Tile::kRowsPerLane; m += warps) {
      const int d = ro + R * m, at = d * L + cg;
      // Row d's key is column d of a key row: lane d % 32 holds it, in the slot that every lane
      // of the warp reads alike (R rows at once never straddle 32 columns).
      const int slot = R * m / kWarp;
      float4 w;
      if constexpr (kSplit) {
        const uint2* halves = reinterpret_cast<const uint2*>(w1);
        w = JoinHalves(halves[at], halves[kF * L + at]);
      } else {
        w = w1[at];
      }
#pragma unroll
      for (int i = 0; i < kPart; ++i) {
        float key = keys[i][0];
#pragma unroll
        for (int other = 1; other < kKeySlots; ++other) key = slot == other ? keys[i][other] : key;
        key = __shfl_sync(0xffffffffu, key, d % kWarp);
        if (first + i < K) w = w - key * scaled[i];
      }
      if constexpr (kSplit) {
        // Back into the shared copy: stored to the state after the loop, in 16-byte pieces (two
        // 8-byte stores a row here made the commit the kernel's tail, bench/README.md v31).
        uint2* halves = reinterpret_cast<uint2*>(w1);
        SplitHalves(w, &halves[at], &halves[kF * L + at]);
      } else if (part == 0) {
        w1[at] = w;
      } else {
        window.W1[at] = w;
      }
    }
  }
  if constexpr (kSplit) {
    // Rows R·m … R·m + R − 1 are 128 halves, 256 bytes a plane: 16 lanes store each plane's.
    __syncwarp();
    const int piece = lane % 16;
    const uint4* from = reinterpret_cast<const uint4*>(w1) + (lane < 16 ? 0 : kF * L / 2);
    uint4* to = reinterpret_cast<uint4*>(lane < 16 ? window.W1_upper : window.W1_lower);
    for (int m = warp; m < Tile::kRowsPerLane; m += warps) {
      to[16 * m + piece] = from[16 * m + piece];
    }
  }
  if (warp == 0 && ro == 0) window.b1[cg] = bias - bias_update;
}

// Where a segment's first token falls in its window, 0 .. K − 1: the window's earlier rows
// pending in the state. θ0 is committed after the token at K − 1.
__device__ __forceinline__ int WindowPosition(const Segment& seg, int K) {
  // Every known model's K is a power of two: a mask, where `%` is a 64-bit division.
  if ((K & (K - 1)) == 0) return static_cast<int>(seg.start & (K - 1));
  return static_cast<int>(seg.start % K);
}

// The window's earlier tokens as a lane holds them: its rows j = ro + R·m < r of keys, step sizes
// and gradients (zero past r).
template <int kF>
struct WindowRows {
  static constexpr int kRows = DecodeTile<kF>::kWindowRowsPerLane;
  float4 keys[kRows];
  float lrs[kRows];
  float4 grads[kRows];
};

// What LoadWindowRows loads of this lane's rows: the keys and step sizes, or the gradients.
enum class WindowPart { kKeys, kGradients };

template <int kF, WindowPart kPart>
__device__ __forceinline__ void LoadWindowRows(const DecodeWindow& window, int r,
                                               WindowRows<kF>& rows) {
  using Tile = DecodeTile<kF>;
  constexpr int L = Tile::kLanesPerRow;
  const int lane = threadIdx.x % kWarp, cg = lane % L, ro = lane / L;
#pragma unroll
  for (int m = 0; m < Tile::kWindowRowsPerLane; ++m) {
    const int j = ro + Tile::kRowsAtOnce * m;
    if constexpr (kPart == WindowPart::kKeys) {
      rows.keys[m] = j < r ? window.k[j * L + cg] : Broadcast4(0.0f);
      rows.lrs[m] = j < r ? window.lr[j] : 0.0f;
    } else {
      rows.grads[m] = j < r ? window.g1[j * L + cg] : Broadcast4(0.0f);
    }
  }
}

// The token of segment `seg` (one row) at head `head`, whose layer state starts at `base`: its
// gradient at θ0 joins the window, its output row (q + LN of the dual-form row) goes to out_all,
// and after the window's last token `commit(window, bias)` commits θ0 (CommitWindow, by this warp
// or with others). W1's copy into w1 (CopyW1Async, DecodeSharedBytes) must be committed before
// the call; `release()` is called once w1 is no longer read. The window's earlier rows are
// loaded into `rows` here, or with kRowsLoaded by the caller before (LoadWindowRows).
template <int kF, int kTaps, bool kSplit, bool kRowsLoaded = false, typename Commit,
          typename Release>
__device__ __forceinline__ void DecodeLinearToken(const TttScanParams& p,
                                                  const TttProjectionInputs& in, Segment seg,
                                                  int head, float* base, const TttStateOffsets& off,
                                                  float4* w1, float* out_all, WindowRows<kF>& rows,
                                                  Commit commit, Release release) {
  using Tile = DecodeTile<kF>;
  constexpr int L = Tile::kLanesPerRow, R = Tile::kRowsAtOnce;
  // q and k in shared memory by row group (ByRowGroup), after W1.
  float* shared_q = reinterpret_cast<float*>(w1 + kF * L);
  float* shared_k = shared_q + kF;
  const int K = p.K, D = p.nh * kF;
  const int lane = threadIdx.x % kWarp, cg = lane % L, ro = lane / L;
  const int r = WindowPosition(seg, K);
  const DecodeWindow window = WindowOf<kF>(p, head, base, off);
  float4* pk = window.k;
  float4* pg = window.g1;
  float* plr = window.lr;

  // The window's earlier tokens (their gradients are loaded once the keys are used, while W1 is
  // in flight).
  if constexpr (!kRowsLoaded) LoadWindowRows<kF, WindowPart::kKeys>(window, r, rows);

  // This token's inputs (spec §3.2–3.4), for this lane's four channels.
  const float* projected = in.proj + static_cast<int64_t>(seg.row) * in.columns.ld;
  const int channel = head * kF + 4 * cg;
  float q[4], k[4], v[4];
  Taps<kTaps> taps[4];
  float* history = base + in.conv.history_offset;
  // The history's row of the token's oldest input, which its own input replaces.
  const int history_rows = kTaps == kFourTaps ? kFourTaps - 1 : in.conv.ck - 1;
  const int oldest = in.share_qk && history_rows > 0 ? HistoryRow(seg.start, history_rows) : 0;
  if constexpr (kTaps == kFourTaps) {
    const float4 projected_v = Load4(projected + in.columns.v + channel);
    if (in.share_qk) {
      FourChannelDecodeTaps(history, oldest, D, channel, Load4(projected + in.columns.q + channel),
                            taps);
      FourChannelConv(taps, channel, in.conv.q_weight, in.conv.q_bias, q);
      FourChannelConv(taps, channel, in.conv.k_weight, in.conv.k_bias, k);
    } else {
      const float4 projected_q = Load4(projected + in.columns.q + channel),
                   projected_k = Load4(projected + in.columns.k + channel);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        q[i] = Channel(projected_q, i);
        k[i] = Channel(projected_k, i);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = Channel(projected_v, i);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (in.share_qk) {
        taps[i] = DecodeTaps<kTaps>(history, oldest, D, channel + i, in.conv.ck,
                                    projected[in.columns.q + channel + i]);
        q[i] = ConvOf(taps[i], channel + i, in.conv.q_weight, in.conv.q_bias, in.conv.ck);
        k[i] = ConvOf(taps[i], channel + i, in.conv.k_weight, in.conv.k_bias, in.conv.ck);
      } else {
        q[i] = projected[in.columns.q + channel + i];
        k[i] = projected[in.columns.k + channel + i];
      }
      v[i] = projected[in.columns.v + channel + i];
    }
  }
  // RoPE at position r in the window: channels (2i, 2i + 1) rotate together.
#pragma unroll
  for (int pair = 0; pair < 2; ++pair) {
    const float2 cos_sin = in.rope[r * (kF / 2) + 2 * cg + pair];
    RotatePair(q[2 * pair], q[2 * pair + 1], cos_sin);
    RotatePair(k[2 * pair], k[2 * pair + 1], cos_sin);
  }
  const float4 q4 = make_float4(q[0], q[1], q[2], q[3]);
  const float4 k4 = make_float4(k[0], k[1], k[2], k[3]);
  const float4 v4 = make_float4(v[0], v[1], v[2], v[3]);
  const float lr_t =
      InnerStepSize(projected[in.columns.lr + head], in.lr_bias[head], in.base_lr, kF);
  __syncwarp();  // Every lane has read the oldest row before row group 0 writes over it.
  if (in.share_qk && ro == 0) {
    if constexpr (kTaps == kFourTaps) {
      FourChannelAppendToHistory(history, oldest, D, channel, taps);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        AppendToHistory(history, oldest, D, in.conv.ck, channel + i, taps[i]);
      }
    }
  }
  if (ro == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      shared_q[ByRowGroup<kF>(4 * cg + i)] = q[i];
      shared_k[ByRowGroup<kF>(4 * cg + i)] = k[i];
    }
  }

  // coef_j = τ_r·lr_j·(q·k_j + 1) for the window's earlier tokens (zero past them).
  const float tau_r = p.tau[r];
  float coef[Tile::kWindowRowsPerLane];
#pragma unroll
  for (int m = 0; m < Tile::kWindowRowsPerLane; ++m) {
    coef[m] = tau_r * rows.lrs[m] * (ColumnSum<kF>(Dot4(q4, rows.keys[m])) + 1.0f);
  }
  if constexpr (!kRowsLoaded) LoadWindowRows<kF, WindowPart::kGradients>(window, r, rows);

  const float4 bias = LaneBias<kF>(window);
  const float4 gamma = reinterpret_cast<const float4*>(p.ln_weight + head * kF)[cg];
  const float4 beta = reinterpret_cast<const float4*>(p.ln_bias + head * kF)[cg];
  __pipeline_wait_prior(0);
  __syncwarp();  // W1, q and k are in shared memory.

  // z1 = k·W1 + b1 and zq = q·W1 + b1 (this lane: its rows' share of its columns).
  float4 z1 = Broadcast4(0.0f), zq = Broadcast4(0.0f);
  constexpr int kLoad = Tile::kRowsPerLane % 4 == 0 ? 4 : 1;  // Rows of q and k a load.
  using Rows = std::conditional_t<kLoad == 4, float4, float>;
  const Rows* k_rows = reinterpret_cast<const Rows*>(shared_k + ro * Tile::kRowsPerLane);
  const Rows* q_rows = reinterpret_cast<const Rows*>(shared_q + ro * Tile::kRowsPerLane);
#pragma unroll
  for (int load = 0; load < Tile::kRowsPerLane / kLoad; ++load) {
    const Rows k_load = k_rows[load], q_load = q_rows[load];
#pragma unroll
    for (int i = 0; i < kLoad; ++i) {
      const int m = kLoad * load + i;
      const float4 w = CopiedW1<kF, kSplit>(w1, ro + R * m, cg);
      z1 = z1 + RowOf(k_load, i) * w;
      zq = zq + RowOf(q_load, i) * w;
    }
  }
  // Unless this token commits θ0, W1 is not read again: the next item's copy starts.
  const bool commits = r == K - 1;
  if (!commits) {
    __syncwarp();
    release();
  }
  z1 = make_float4(RowGroupSum<kF>(z1.x), RowGroupSum<kF>(z1.y), RowGroupSum<kF>(z1.z),
                   RowGroupSum<kF>(z1.w)) +
       bias;
  zq = make_float4(RowGroupSum<kF>(zq.x), RowGroupSum<kF>(zq.y), RowGroupSum<kF>(zq.z),
                   RowGroupSum<kF>(zq.w)) +
       bias;

  // The gradient of this token's loss at θ0 (spec §3.5): ∂/∂z1 of ½‖LN(z1) − (v − k)‖².
  float inv_std;
  const float4 z1_centred = CentreColumns<kF>(z1, p.ln_eps, &inv_std);
  const float4 xhat = inv_std * z1_centred;
  const float4 e = gamma * (gamma * xhat + beta - (v4 - k4));
  const float sum_e = ColumnSum<kF>(Sum4(e)), sum_e_xhat = ColumnSum<kF>(Dot4(e, xhat));
  const float4 g =
      (inv_std / kF) * (static_cast<float>(kF) * e - Broadcast4(sum_e) - sum_e_xhat * xhat);
  if (ro == 0) {
    pk[r * L + cg] = k4;
    pg[r * L + cg] = g;
  }
  if (lane == 0) plr[r] = lr_t;

  // The dual-form row: z̄ = zq − Σ_{j≤r} τ_r·lr_j·(q·k_j + 1)·g_j, out = q + LN(z̄).
  float4 dual = Broadcast4(0.0f);
#pragma unroll
  for (int m = 0; m < Tile::kWindowRowsPerLane; ++m) dual = dual + coef[m] * rows.grads[m];
  dual = make_float4(RowGroupSum<kF>(dual.x), RowGroupSum<kF>(dual.y), RowGroupSum<kF>(dual.z),
                     RowGroupSum<kF>(dual.w));
  const float coef_r = tau_r * lr_t * (ColumnSum<kF>(Dot4(q4, k4)) + 1.0f);
  const float4 zbar = zq - dual - coef_r * g;
  float out_inv_std;
  const float4 out_centred = CentreColumns<kF>(zbar, p.ln_eps, &out_inv_std);
  if (ro == 0) {
    reinterpret_cast<float4*>(out_all + static_cast<int64_t>(seg.row) * D + head * kF)[cg] =
        q4 + gamma * (out_inv_std * out_centred) + beta;
  }
  // After the window's last token θ0 becomes θ̄ (CommitWindow): here, or by the caller's warps.
  if (commits) {
    __syncwarp();  // This token's row of keys and gradients, stored above, is visible.
    commit(window, bias);
    __syncwarp();
    release();
  }
}

}  // namespace ttt::kernels::cuda
