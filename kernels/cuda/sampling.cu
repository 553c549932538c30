// Next-token choice on the GPU, one block per row of logits, so only ids and log-probs leave it.
//
// The kept set is every token whose tempered score reaches the thresholds of top-k, top-p and
// min-p (found by radix select on the scores' bits instead of a sort), and the draw walks the kept
// tokens in id order: the same rule as the CPU sampler, so both pick the same token for the same
// seed whenever their kept sets agree.
#include <cfloat>
#include <climits>

#include "kernels/cuda/common.cuh"

namespace ttt::kernels::cuda {
namespace {

constexpr int kThreads = 1024;

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

// ---- Truncation: top-k and top-p thresholds by radix select ------------------------------------
//
// A tempered score s = (l − top)/T is ≤ 0, so its bits without the sign, |s|'s, order the tokens:
// a token's rank key is 0 at the top and grows as s falls (NaN ranks with −∞, as the CPU sampler
// sorts it). The k-th smallest key and the key where the mass of the keys below reaches top-p are
// found a digit at a time, most significant first, each digit by one pass over the tokens that
// counts them per digit value (and for top-p their mass): four passes at most, where a bisection
// on the value took forty per threshold (bench/README.md v53). The counts are integers and the
// masses fixed-point, so the sums do not depend on the order the block adds them in, and a seed
// draws the same token every time.
//
// Top-k's first digit is 11 bits wide, the exponent and three bits of the mantissa: by the
// exponent alone a row's tail (most of it, when one token stands far above the rest) shares one
// bin, and every later pass reads the whole row. With the finer digit the k-th key's bin and those
// below it usually hold few tokens; once they fit in shared memory, the next pass, which reads the
// row anyway, gathers their ids there, and the passes after it, top-p's included, read those
// tokens alone (bench/README.md v55). Top-p's own search gathers the same way, where its nucleus
// fits (v56). The gathered tokens hold every kept one, so where few are kept the draw walks them
// instead of the row (v57).
constexpr uint32_t kKeyOfMinusInf = 0x7f800000u;
constexpr int kKeyBits = 31, kDigitBits = 8, kTopKFirstDigitBits = 11;
constexpr int kDigitValues = 1 << kDigitBits;
// A token's mass exp(s) ≤ 1 in units of 2^−26: a warp's 32 fit in 32 bits.
constexpr float kMassUnits = 67108864.0f;
// Where DigitHistogram splits a bin's mass: the low sum stays under V·2^13, the high one at most
// V·2^26 / 2^13, both under 2^32 for V < 2^19 (kMaxSamplerVocabulary).
constexpr int kMassLowBits = 13;

__device__ __forceinline__ uint32_t RankKey(float s) {
  return isnan(s) ? kKeyOfMinusInf : __float_as_uint(s) & 0x7fffffffu;
}

// The tokens a threshold keeps: those whose key, shifted right by `shift`, is at most `prefix`.
// Found before its last digit, when the digit's bin holds one token or is kept whole, the
// threshold stops at that digit.
struct RankLimit {
  uint32_t prefix = 0x7fffffffu;
  int shift = 0;

  __device__ bool Keeps(uint32_t key) const { return (key >> shift) <= prefix; }
};

// Shared memory is taken from L1, where a row's later passes find its logits again: 6 KB more a
// block made every setting that reads a row twice 1–3 µs slower (v55). So the histogram is 1,648
// words, and the block's shared memory under 7 KB:
// - a pass's counts per digit value in words [0, digits), save that top-k's 11-bit first pass packs
//   two 16-bit counts a word in [0, 1,024) (it is taken only for rows of fewer than 65,536 tokens,
//   so no bin overflows);
// - a pass that also sums masses (top-p's, 8-bit digits) keeps a bin's mass in two 32-bit words:
//   at kDigitValues + d the sum of each add's low kMassLowBits bits, at 2 kDigitValues + d the sum
//   of the rest. A 32-bit add to shared memory is one atomic instruction, a 64-bit one a
//   compare-and-swap loop, which retries while the block's warps add into the same few bins
//   (v54); and split so, neither sum overflows in a row of fewer than 2^19 tokens (each token's
//   mass is at most 2^26), so no add waits for the value before it to see a carry (v56);
// - the ids of the tokens gathered after a search's digit in the words after those.
struct DigitHistogram {
  static constexpr int kWords = 1648, kGatherCapacity = kWords - 3 * kDigitValues;
  uint32_t words[kWords];

  __device__ uint32_t* Gathered() { return words + 3 * kDigitValues; }

  __device__ uint32_t Count(int d, bool packed) const {
    return packed ? words[d / 2] >> (d % 2 * 16) & 0xffffu : words[d];
  }
  __device__ unsigned long long Mass(int d) const {
    return (static_cast<unsigned long long>(words[2 * kDigitValues + d]) << kMassLowBits) +
           words[kDigitValues + d];
  }
  __device__ void Add(int d, uint32_t count, uint32_t mass, bool by_mass, bool packed) {
    if (packed) {
      atomicAdd(&words[d / 2], count << (d % 2 * 16));
      return;
    }
    atomicAdd(&words[d], count);
    if (!by_mass) return;
    atomicAdd(&words[kDigitValues + d], mass & ((1u << kMassLowBits) - 1));
    atomicAdd(&words[2 * kDigitValues + d], mass >> kMassLowBits);
  }
};

// A count of tokens and their mass, as the digit search sums them over bins.
struct BinSums {
  uint32_t count;
  unsigned long long mass;
};

// Where a pass's digit search ended.
struct DigitFound {
  int digit;
  bool settled;                    // The threshold needs no lower digit.
  uint32_t count_before;           // Of the tokens searched, those below the digit's bin,
  uint32_t count_through;          // and those through it.
  unsigned long long mass_before;  // The mass of the searched tokens below the digit's bin.
};

// The truncation's shared memory.
struct TruncationShared {
  DigitHistogram histogram;
  DigitFound found;
  int gathered_count;  // −1: no tokens gathered.
  int kept_count;      // Of the gathered tokens, those the draw keeps.
};

// The tokens a search reads: the whole row, or those gathered in shared memory.
struct KeySource {
  const float* row;
  int V;
  float top, inv_t;
  int gathered;  // How many ids TruncationShared holds; −1: read the row.

  __device__ int Size() const { return gathered >= 0 ? gathered : V; }
  __device__ uint32_t KeyOf(int id) const { return RankKey((row[id] - top) * inv_t); }
};

// What FindRankLimit looks for: the smallest threshold whose kept tokens number at least `count`,
// or (by mass) hold at least `mass_fraction` of the mass of the tokens `within` keeps.
struct RankGoal {
  uint32_t count;
  float mass_fraction;
  RankLimit within;
};

// The sums over the threads before this one (in thread order), and over the block.
template <bool kByMass>
__device__ BinSums BinSumsBefore(BinSums v, BinSums* scratch, BinSums* total) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  auto scan_warp = [&](BinSums s) {
    for (int o = 1; o < kWarp; o *= 2) {
      const uint32_t c = __shfl_up_sync(0xffffffffu, s.count, o);
      const unsigned long long m = kByMass ? __shfl_up_sync(0xffffffffu, s.mass, o) : 0;
      if (lane >= o) {
        s.count += c;
        s.mass += m;
      }
    }
    return s;
  };
  const BinSums inclusive = scan_warp(v);
  __syncthreads();
  if (lane == kWarp - 1) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const BinSums none = {0, 0};
    scratch[lane] = scan_warp(lane < blockDim.x / kWarp ? scratch[lane] : none);  // Inclusive.
  }
  __syncthreads();
  *total = scratch[blockDim.x / kWarp - 1];
  const BinSums before = warp > 0 ? scratch[warp - 1] : BinSums{0, 0};
  return {before.count + inclusive.count - v.count, before.mass + inclusive.mass - v.mass};
}

// The smallest RankLimit reaching `goal` over the tokens of `source`. A search from the row that
// `may_gather`, once the tokens of the digit found and those below it fit, gathers their ids into
// `shared` during its next pass and reads those tokens alone from then on; a search within its
// limit can read them too. A search by mass takes 8-bit digits (its bins' masses are sized
// for 256).
template <bool kByMass>
__device__ RankLimit FindRankLimit(KeySource source, const RankGoal& goal, int first_digit_bits,
                                   bool may_gather, TruncationShared* shared, BinSums* scratch) {
  const int lane = threadIdx.x % kWarp;
  DigitHistogram& histogram = shared->histogram;
  uint32_t prefix = 0;  // The digits found so far.
  uint32_t count_before = 0;
  unsigned long long mass_needed = 0;  // What the goal still lacks, from tokens under the prefix.
  bool gathering = false;              // This pass gathers the keys at or below the prefix.
  for (int high = kKeyBits, bits = first_digit_bits; high > 0; high -= bits, bits = kDigitBits) {
    const int shift = max(0, high - bits), digits = 1 << (high - shift);
    const bool packed = digits > kDigitValues;
    const int words = kByMass ? 3 * kDigitValues : packed ? digits / 2 : digits;
    for (int w = threadIdx.x; w < words; w += blockDim.x) histogram.words[w] = 0;
    if (gathering && threadIdx.x == 0) shared->gathered_count = 0;
    __syncthreads();
    // The pass over the tokens, `key_of(i)` the i-th's key. Every lane of a warp takes the same
    // number of turns, for the warp-wide votes below.
    const int n = source.Size();
    auto pass = [&](auto key_of) {
      for (int first = 0; first < n; first += blockDim.x) {
        const int i = first + threadIdx.x;
        int digit = -1;
        uint32_t mass = 0;
        uint32_t key = 0;
        if (i < n) {
          key = key_of(i);
          if (goal.within.Keeps(key) && (key >> high) == prefix) {
            digit = static_cast<int>((key >> shift) & (digits - 1));
            // (The key of −∞, and of NaN, has no mass.)
            if (kByMass) mass = __float2uint_rn(expf(-__uint_as_float(key)) * kMassUnits);
          }
        }
        if (gathering) {
          // Each warp's ids at consecutive places, one shared-memory add a warp. The pass before
          // counted these very tokens, so they fit.
          const bool take = i < n && goal.within.Keeps(key) && (key >> high) <= prefix;
          const unsigned takers = __ballot_sync(0xffffffffu, take);
          int place = 0;
          if (lane == 0 && takers != 0) place = atomicAdd(&shared->gathered_count, __popc(takers));
          place = __shfl_sync(0xffffffffu, place, 0) + __popc(takers & ((1u << lane) - 1));
          if (take) histogram.Gathered()[place] = i;  // Read from the row: i is the id.
        }
        // A later digit is finer than the spread of the bin it splits, so a warp's tokens mostly
        // fall in bins of their own: each adds itself. Grouping them by value first (below) made
        // flat rows' top-p twice as slow (bench/README.md v56). Most warps hold none of them.
        if (high != kKeyBits) {
          if (digit >= 0) histogram.Add(digit, 1u, mass, kByMass, packed);
          continue;
        }
        // The first digit, where a row's tokens crowd a few bins: one shared-memory add per digit
        // value a warp holds, not one per token.
        if (!__any_sync(0xffffffffu, digit >= 0)) continue;
        const unsigned peers = __match_any_sync(0xffffffffu, digit);
        const uint32_t peers_mass = kByMass ? __reduce_add_sync(peers, mass) : 0u;
        if (digit >= 0 && lane == __ffs(peers) - 1) {
          histogram.Add(digit, static_cast<uint32_t>(__popc(peers)), peers_mass, kByMass, packed);
        }
      }
    };
    // A loop each, so that the row's loads wait on no shared-memory read: in one loop, either
    // form of the key made the passes over the row slower (top-k 5,000 +11 µs, v57).
    if (source.gathered >= 0) {
      const uint32_t* ids = histogram.Gathered();
      pass([&](int i) { return source.KeyOf(static_cast<int>(ids[i])); });
    } else {
      pass([&](int i) { return source.KeyOf(i); });
    }
    __syncthreads();
    if (gathering) {
      source.gathered = shared->gathered_count;
      gathering = false;
    }
    // Thread t sums bins [t·per, t·per + per); a scan over the block gives the sums below each.
    const int per = (digits + blockDim.x - 1) / blockDim.x;
    const int begin = min(digits, static_cast<int>(threadIdx.x) * per);
    const int end = min(digits, begin + per);
    BinSums mine = {0, 0};
    for (int d = begin; d < end; ++d) {
      mine.count += histogram.Count(d, packed);
      if (kByMass) mine.mass += histogram.Mass(d);
    }
    BinSums total;
    const BinSums below = BinSumsBefore<kByMass>(mine, scratch, &total);
    // The first pass sees every token the goal counts: their mass sets the goal.
    if (kByMass && high == kKeyBits) {
      mass_needed = static_cast<unsigned long long>(
          ceil(static_cast<double>(goal.mass_fraction) * static_cast<double>(total.mass)));
    }
    // Whether the tokens up to c (of all searched) and m (of this pass's bins) reach the goal.
    auto reached = [&](uint32_t c, unsigned long long m) {
      return kByMass ? m >= mass_needed : c >= goal.count;
    };
    DigitFound f;
    if (reached(count_before, 0) || !reached(count_before + total.count, total.mass)) {
      // Reached before this digit's bins (a goal of nothing), or never (cannot happen): the
      // smallest digit value.
      f = {0, true, count_before, count_before, 0};
    } else {
      uint32_t c = count_before + below.count;
      unsigned long long m = below.mass;
      // The one thread whose bins hold the first digit value at which the goal is reached.
      if (!reached(c, m) && reached(c + mine.count, m + mine.mass)) {
        int d = begin;
        for (;; ++d) {
          if (reached(c + histogram.Count(d, packed), kByMass ? m + histogram.Mass(d) : 0)) break;
          c += histogram.Count(d, packed);
          if (kByMass) m += histogram.Mass(d);
        }
        // With one token in its bin, or the goal met exactly by the whole bin's count, every
        // token of the bin is kept and no token after it: the digit settles the threshold.
        const uint32_t in_bin = histogram.Count(d, packed), through = c + in_bin;
        const bool settled = in_bin == 1 || (!kByMass && through == goal.count);
        shared->found = DigitFound{d, settled, c, through, m};
      }
      __syncthreads();
      f = shared->found;
    }
    prefix = prefix << (high - shift) | static_cast<uint32_t>(f.digit);
    count_before = f.count_before;
    mass_needed -= f.mass_before;
    if (f.settled || shift == 0) return {prefix, shift};
    if (may_gather && source.gathered < 0 && f.count_through <= DigitHistogram::kGatherCapacity) {
      // Every token the limit will keep: all that a top-p search within it reads.
      gathering = true;
    }
  }
  return {prefix, 0};
}

// ---- The draw ---------------------------------------------------------------------------------
//
// u times the kept mass falls in one kept token's share, walking the kept tokens in id order, as
// the CPU sampler does. `mass(id)`: exp of the token's tempered score where it is kept, else 0.

// The draw over the whole row: V where nothing is kept. Warp w owns a contiguous run of ids and
// reads it 32 ids at a time, so every load is coalesced.
template <typename Mass>
__device__ int DrawFromRow(int V, Mass mass, double u, float* scratch_sums, int* scratch_ints) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int run = (V + warps * kWarp - 1) / (warps * kWarp) * kWarp;
  const int begin = min(V, warp * run), end = min(V, begin + run);
  auto run_mass = [&](int i) { return i < end ? mass(i) : 0.0f; };
  float mine = 0;
  for (int i = begin + lane; i < end; i += kWarp) mine += mass(i);
  const float warp_mass = WarpSum(mine);
  float kept_total;
  float running = BlockExclusiveScan(lane == 0 ? warp_mass : 0.0f, scratch_sums, &kept_total);
  running = __shfl_sync(0xffffffffu, running, 0);
  const float target = static_cast<float>(u) * kept_total;
  int found_id = V, last_kept = V;
  if (running <= target && target < running + warp_mass) {
    // 32 ids a round: the round's masses summed across the lanes in id order. Rounding can leave
    // the target past the run's last kept token (the sums above went in another order): that
    // token is taken.
    for (int first = begin; first < end && found_id == V; first += kWarp) {
      const int i = first + lane;
      const float e = run_mass(i);
      float through = e;  // This round's mass up to and including lane's id.
      for (int o = 1; o < kWarp; o *= 2) {
        const float before = __shfl_up_sync(0xffffffffu, through, o);
        if (lane >= o) through += before;
      }
      const unsigned crossed = __ballot_sync(0xffffffffu, e > 0 && target < running + through);
      const unsigned any_kept = __ballot_sync(0xffffffffu, e > 0);
      if (crossed != 0) {
        found_id = first + __ffs(crossed) - 1;
      } else if (any_kept != 0) {
        last_kept = first + kWarp - __clz(any_kept) - 1;
      }
      running += __shfl_sync(0xffffffffu, through, kWarp - 1);
    }
    if (found_id == V) found_id = last_kept;
  }
  return BlockMin(lane == 0 ? found_id : V, scratch_ints);
}

// Kept tokens the draw over gathered tokens takes at most: it ranks them by id, each against all.
constexpr int kMostKeptFromGathered = 256;
static_assert(DigitHistogram::kGatherCapacity <= kThreads, "a gathered token a thread");
static_assert(2 * kMostKeptFromGathered <= 3 * kDigitValues, "kept tokens below the gathered");

// The draw over the `n` tokens gathered in `shared` (which hold every kept token, and whose words
// before them no search needs any more): DrawFromRow's, over the kept ones alone. V where nothing
// is kept; −1 where more are kept than it takes (the row's draw is then taken). A top-k's draw
// read the whole row for ~50 tokens (bench/README.md v57).
template <typename Mass>
__device__ int DrawFromGathered(int n, int V, Mass mass, double u, TruncationShared* shared,
                                float* scratch_sums, int* scratch_ints) {
  uint32_t* kept_ids = shared->histogram.words;
  float* kept_masses = reinterpret_cast<float*>(kept_ids + kMostKeptFromGathered);
  const int lane = threadIdx.x % kWarp, t = threadIdx.x;
  if (t == 0) shared->kept_count = 0;
  __syncthreads();
  // The kept tokens, in the order warps reach them.
  const uint32_t id = t < n ? shared->histogram.Gathered()[t] : 0;
  const float e = t < n ? mass(static_cast<int>(id)) : 0.0f;
  const unsigned takers = __ballot_sync(0xffffffffu, e > 0);
  int place = 0;
  if (lane == 0 && takers != 0) place = atomicAdd(&shared->kept_count, __popc(takers));
  place = __shfl_sync(0xffffffffu, place, 0) + __popc(takers & ((1u << lane) - 1));
  if (e > 0 && place < kMostKeptFromGathered) {
    kept_ids[place] = id;
    kept_masses[place] = e;
  }
  __syncthreads();
  const int kept = shared->kept_count;
  if (kept == 0) return V;
  if (kept > kMostKeptFromGathered) return -1;
  // In id order (ids are distinct), so that the sums below go in one order on every run.
  uint32_t my_id = 0;
  float my_mass = 0;
  int rank = 0;
  if (t < kept) {
    my_id = kept_ids[t];
    my_mass = kept_masses[t];
    for (int j = 0; j < kept; ++j) rank += kept_ids[j] < my_id;
  }
  __syncthreads();
  if (t < kept) {
    kept_ids[rank] = my_id;
    kept_masses[rank] = my_mass;
  }
  __syncthreads();
  const float v = t < kept ? kept_masses[t] : 0.0f;
  float kept_total;
  const float running = BlockExclusiveScan(v, scratch_sums, &kept_total);
  const float target = static_cast<float>(u) * kept_total;
  const int crossing = BlockMin(t < kept && target < running + v ? t : INT_MAX, scratch_ints);
  // Rounding can leave the target past the last kept token: that token is taken.
  return static_cast<int>(kept_ids[crossing == INT_MAX ? kept - 1 : crossing]);
}

// Two blocks an SM, so 32 registers a thread: with more, a step's 256 rows take two waves.
__global__ void __launch_bounds__(kThreads, 2)
    SampleKernel(const float* logits, int V, const SamplingRow* rows, int32_t* ids,
                 float* logprobs) {
  // Each use of the scratch begins with a __syncthreads(), so one area serves them all.
  __shared__ union {
    float sums[kWarp];
    int ints[kWarp];
    RowSummary summaries[kWarp];
    BinSums bins[kWarp];
  } scratch;
  __shared__ TruncationShared truncation;
  if (threadIdx.x == 0) truncation.gathered_count = -1;
  WaitForPreviousKernel();
  const float* row = logits + static_cast<int64_t>(blockIdx.x) * V;
  const SamplingRow p = rows[blockIdx.x];
  const RowSummary summary = SummarizeRow(row, V, scratch.summaries);
  const float top = summary.top;
  const float log_sum = logf(summary.sum);
  // A row with no logit above −FLT_MAX (NaN or −∞ throughout: a broken model) has no first; it
  // takes id 0, as the CPU sampler does, so that nothing reads past the row or the embeddings.
  const int most_likely = summary.first < V ? summary.first : 0;

  int chosen;
  if (p.temperature == 0.0f || p.top_k == 1) {
    chosen = most_likely;
  } else {
    // As the CPU sampler: top-k's tokens, of which top-p takes the nucleus of their mass, and
    // min-p those at least min_p as likely as the top (s ≥ log min_p); a token is kept by all
    // three.
    const float inv_t = 1.0f / p.temperature;
    auto score = [&](int i) { return (row[i] - top) * inv_t; };
    const KeySource from_row = {row, V, top, inv_t, -1};
    RankLimit k_limit, p_limit;
    if (p.top_k > 0 && p.top_k < V) {
      // Two 16-bit counts a word in the first pass hold a row of fewer than 65,536 tokens.
      const int first_digit_bits = V < 65536 ? kTopKFirstDigitBits : kDigitBits;
      k_limit = FindRankLimit<false>(from_row, RankGoal{static_cast<uint32_t>(p.top_k), 0, {}},
                                     first_digit_bits, true, &truncation, scratch.bins);
    }
    if (p.top_p < 1.0f) {
      const KeySource from_gathered = {row, V, top, inv_t, truncation.gathered_count};
      p_limit = FindRankLimit<true>(from_gathered, RankGoal{0, p.top_p, k_limit}, kDigitBits, true,
                                    &truncation, scratch.bins);
    }
    // The lowest score min-p keeps (NaN fails it).
    const float lowest = p.min_p > 0 ? logf(p.min_p) : -INFINITY;
    auto mass = [&](int i) {
      const float s = score(i);
      const uint32_t key = RankKey(s);
      return s >= lowest && k_limit.Keeps(key) && p_limit.Keeps(key) ? expf(s) : 0.0f;
    };
    const double u = static_cast<double>(Mix(Mix(p.seed) ^ p.step) >> 11) * 0x1.0p-53;
    int found_id = -1;
    if (truncation.gathered_count >= 0) {
      found_id = DrawFromGathered(truncation.gathered_count, V, mass, u, &truncation, scratch.sums,
                                  scratch.ints);
    }
    if (found_id < 0) found_id = DrawFromRow(V, mass, u, scratch.sums, scratch.ints);
    // A row that keeps no mass (−∞ or NaN throughout) takes the most likely token.
    chosen = found_id < V ? found_id : most_likely;
  }
  if (threadIdx.x == 0) {
    ids[blockIdx.x] = chosen;
    logprobs[blockIdx.x] = row[chosen] - top - log_sum;
  }
}

}  // namespace

cudaError_t SampleTokens(const float* logits, int rows, int V, const SamplingRow* params,
                         int32_t* ids, float* logprobs, cudaStream_t stream) {
  if (V > kMaxSamplerVocabulary) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return Launch(SampleKernel, rows, kThreads, 0, stream, logits, V, params, ids, logprobs);
}

}  // namespace ttt::kernels::cuda
