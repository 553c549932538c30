// The p-quantile of a sample by nearest rank: the value at index ⌊p·n⌋ of the sample in order (the
// last one for p near 1), and 0 for an empty sample. ttt-bench's and ttt-loadgen's figures.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace ttt {

inline double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  const size_t i = std::min(values.size() - 1, static_cast<size_t>(p * values.size()));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(i), values.end());
  return values[i];
}

}  // namespace ttt
