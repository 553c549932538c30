#include "server/engine/decode_order.h"

#include <algorithm>

namespace ttt {

void PlanDecodeOrder(std::span<const DecodeWork> work, int heads, int warps,
                     std::span<int32_t> order) {
  const int64_t segments = static_cast<int64_t>(work.size());
  int64_t live = 0;
  for (DecodeWork w : work) live += w != DecodeWork::kIdle;
  std::fill(order.begin(), order.end(), -1);

  // Warps at or past `lighter_from` take an item fewer than those before it. An order index
  // whose items all fall there (no wrap past the last warp) takes a committing segment.
  const int64_t items = live * heads;
  int64_t placed_commits = 0;
  if (warps > 0 && items > warps && items % warps != 0) {
    const int64_t lighter_from = items % warps;
    int64_t next_commit = 0;
    for (int64_t s = 0; s < live; ++s) {
      const int64_t first_warp = s * heads % warps;
      if (first_warp < lighter_from || first_warp + heads > warps) continue;
      while (next_commit < segments && work[next_commit] != DecodeWork::kCommit) ++next_commit;
      if (next_commit == segments) break;
      order[s] = static_cast<int32_t>(next_commit++);
      ++placed_commits;
    }
  }

  // The free places in turn: the other live segments in batch order (the committing ones placed
  // above are the first placed_commits of them), then the idle ones.
  int64_t place = 0;
  auto put = [&](int64_t segment) {
    while (order[place] != -1) ++place;
    order[place] = static_cast<int32_t>(segment);
  };
  int64_t skipped_commits = 0;
  for (int64_t i = 0; i < segments; ++i) {
    if (work[i] == DecodeWork::kIdle) continue;
    if (work[i] == DecodeWork::kCommit && skipped_commits < placed_commits) {
      ++skipped_commits;
      continue;
    }
    put(i);
  }
  for (int64_t i = 0; i < segments; ++i) {
    if (work[i] == DecodeWork::kIdle) put(i);
  }
}

}  // namespace ttt
