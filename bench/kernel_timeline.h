// The kernels the GPU ran, each with its start and end on the GPU's clock, as they ran:
// kernels that overlap (programmatic dependent launch, a graph's branches) show it. ncu times
// each kernel alone, serialised, so it cannot show what a step's overlap hides. Recorded
// through CUPTI's activity records, which do not serialise kernels. The host's CUDA calls
// (runtime and driver API, cuBLASLt's launches among them) come with them, on the same clock:
// where a step outside a graph waits for the host, they say what the host was doing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ttt {

struct KernelSpan {
  std::string name;  // Demangled, without its parameter list.
  uint32_t launch;   // The launching call's correlation id: one per graph launch.
  uint32_t stream;
  int64_t grid, block;  // Blocks, and threads per block.
  uint64_t start_ns, end_ns;
};

struct HostCall {
  std::string name;  // The API function: cudaLaunchKernelExC, cuLaunchKernelEx, ...
  uint32_t thread;
  uint64_t start_ns, end_ns;
};

struct Timeline {
  std::vector<KernelSpan> kernels;
  std::vector<HostCall> host_calls;
};

// Starts recording every kernel and CUDA call of the process. Start before any CUDA graph is
// captured: CUPTI may not see the kernels of graphs made before it records.
absl::Status StartTimeline();
// Waits for the device, then returns (and forgets) every kernel that ran and every call made
// since the start or the last take.
absl::StatusOr<Timeline> TakeTimeline();

}  // namespace ttt
