// How the blocks of a persistent kernel (a cooperative launch: every block resident) wait for
// each other, and its threads for a shared-memory barrier's phase (a copy landing, a slot freed).
#pragma once

#include <cuda/atomic>
#include <cuda/ptx>

namespace ttt::kernels::cuda {

// A grid barrier in halves, for blocks that publish their writes without waiting for the others':
// every block arrives, and those that read the others' writes then wait. `arrivals` counts
// arrivals over the launch (each round adds gridDim.x), `expected` this block's count of them so
// far. `block_sync` syncs the block's threads that take part; the one with `leader` set arrives
// and waits for the block.
template <typename BlockSync>
__device__ __forceinline__ void GridArrive(unsigned* arrivals, unsigned& expected, bool leader,
                                           BlockSync block_sync) {
  block_sync();
  expected += gridDim.x;
  if (leader) {
    // The release is cumulative: it publishes the writes the sync above ordered before it.
    ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device>(*arrivals).fetch_add(
        1, ::cuda::memory_order_release);
  }
}

template <typename BlockSync>
__device__ __forceinline__ void GridWait(unsigned* arrivals, unsigned expected, bool leader,
                                         BlockSync block_sync) {
  if (leader) {
    ::cuda::atomic_ref<unsigned, ::cuda::thread_scope_device> count(*arrivals);
    while (count.load(::cuda::memory_order_acquire) < expected) {
    }
  }
  block_sync();
}

// Every block arrives; returns once all have.
template <typename BlockSync>
__device__ __forceinline__ void GridBarrier(unsigned* arrivals, unsigned& expected, bool leader,
                                            BlockSync block_sync) {
  GridArrive(arrivals, expected, leader, block_sync);
  GridWait(arrivals, expected, leader, block_sync);
}

// Returns once the mbarrier has completed the phase of this parity.
__device__ __forceinline__ void WaitForPhase(uint64_t* mbarrier, int parity) {
  while (!::cuda::ptx::mbarrier_try_wait_parity(mbarrier, static_cast<uint32_t>(parity))) {
  }
}

}  // namespace ttt::kernels::cuda
