// The order in which the batched decode kernel (cu::TttDecode) takes a step's segments.
//
// The kernel runs a warp an item (a segment's head) and deals the items out by position: the
// items of the segment at order index s sit at positions s·heads … s·heads + heads − 1, and
// position p runs on warp p mod warps. So where there are more items than warps, some warps take
// one item more than the others. A segment whose token closes its window also commits θ0 (W1
// rewritten from the window's rows), which roughly doubles its items' work; dealt out in batch
// order, such items land as often on the busier warps, as their last item, and the kernel waits
// for them. Placed where the warps take an item fewer, they run beside the other warps' second
// items instead of after them (bench/README.md v28).
#pragma once

#include <cstdint>
#include <span>

namespace ttt {

enum class DecodeWork : uint8_t {
  kIdle,    // No token: a batch bucket's padding.
  kToken,   // One token.
  kCommit,  // One token that closes its window.
};

// Fills `order` (one entry a segment) with the segments' indices: those that commit placed, as
// far as they fit, where every item falls on a warp with an item fewer than the busiest ones,
// the earliest such places first; then the other segments with a token, in batch order; idle
// segments last (the kernel skips them). `warps` is the kernel's grid (cu::TttDecodeWarps).
void PlanDecodeOrder(std::span<const DecodeWork> work, int heads, int warps,
                     std::span<int32_t> order);

}  // namespace ttt
