// How the blocks of a persistent kernel (a cooperative launch: every block resident) wait for
// each other.
#pragma once

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

}  // namespace ttt::kernels::cuda
