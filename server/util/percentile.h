// The p-quantile of a sample by nearest rank: the value at index ⌊p·n⌋ of the sample in order (the
// last one for p near 1), and T{} for an empty sample. ttt-bench's and ttt-loadgen's figures, the
// engine's timing of its batch-1 paths, and the standalone CUDA benchmarks' medians.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace ttt {

template <typename T>
T Percentile(std::vector<T> values, double p) {
  if (values.empty()) return T{};
  const size_t i = std::min(values.size() - 1, static_cast<size_t>(p * values.size()));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(i), values.end());
  return values[i];
}

// The upper of the middle two for an even count.
template <typename T>
T Median(std::vector<T> values) {
  return Percentile(std::move(values), 0.5);
}

}  // namespace ttt
