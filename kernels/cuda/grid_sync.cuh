// How the blocks of a persistent kernel (a cooperative launch: every block resident) wait for
// each other: a grid barrier, or values tagged with the round that wrote them.
#pragma once

#include <cstdint>
#include <cuda/atomic>

namespace ttt::kernels::cuda {

// Every block arrives; returns once all have. `arrivals` counts arrivals over the launch (each
// barrier adds gridDim.x), `expected` this block's count of them so far. `block_sync` syncs the
// block's threads that take part, of which the one with `arriving` set arrives for the block.
template <typename BlockSync>
__device__ __forceinline__ void GridBarrier(unsigned* arrivals, unsigned& expected, bool arriving,
                                            BlockSync block_sync) {
  block_sync();
  expected += gridDim.x;
  if (arriving) {
    // The release is cumulative: it publishes the writes the sync above ordered before it.
    ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device> count(*arrivals);
    count.fetch_add(1, ::cuda::memory_order_release);
    while (count.load(::cuda::memory_order_acquire) < expected) {
    }
  }
  block_sync();
}

// A float and the round that wrote it, stored and loaded as one 8-byte word, so a reader that
// sees the round sees the value: the writer needs no fence and the reader no barrier. A buffer of
// them is written once a round; round r + 2 may reuse round r's words only once every reader has
// read them.
__device__ __forceinline__ void PublishTagged(uint64_t* word, float value, unsigned round) {
  const uint64_t tagged = static_cast<uint64_t>(round) << 32 | __float_as_uint(value);
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(word), "l"(tagged) : "memory");
}

// Waits for `word` to hold round `round`'s value, and returns it.
__device__ __forceinline__ float AwaitTagged(const uint64_t* word, unsigned round) {
  uint64_t tagged;
  do {
    asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(tagged) : "l"(word) : "memory");
  } while (static_cast<unsigned>(tagged >> 32) != round);
  return __uint_as_float(static_cast<unsigned>(tagged));
}

}  // namespace ttt::kernels::cuda
