#include "bench/kernel_timeline.h"

#include <cuda_runtime.h>
#include <cupti.h>
#include <cxxabi.h>

#include <cstdlib>
#include <mutex>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {
namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;
constexpr size_t kBufferAlignment = 8;  // CUPTI's records need 8-byte alignment.

std::mutex recorded_mutex;
Timeline recorded;  // Guarded by recorded_mutex.

// "void ns::Kernel<T>(int, float*)" → "ns::Kernel<T>".
std::string ShortName(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 ? demangled : mangled;
  std::free(demangled);
  if (!name.empty() && name.back() == ')') {  // Drop the parameter list.
    int depth = 0;
    for (size_t i = name.size(); i-- > 0;) {
      if (name[i] == ')') ++depth;
      if (name[i] == '(' && --depth == 0) {
        name.resize(i);
        break;
      }
    }
  }
  if (std::string_view(name).starts_with("void ")) name.erase(0, 5);
  return name;
}

void CUPTIAPI BufferRequested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlignment, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;  // As many as fit.
}

void CUPTIAPI BufferCompleted(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_bytes) {
  std::lock_guard lock(recorded_mutex);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      recorded.kernels.push_back(
          {.name = ShortName(kernel->name),
           .launch = kernel->correlationId,
           .stream = kernel->streamId,
           .grid = int64_t{kernel->gridX} * kernel->gridY * kernel->gridZ,
           .block = int64_t{kernel->blockX} * kernel->blockY * kernel->blockZ,
           .start_ns = kernel->start,
           .end_ns = kernel->end});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ||
               record->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* call = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const char* name = "unknown";
      cuptiGetCallbackName(record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                       : CUPTI_CB_DOMAIN_DRIVER_API,
                           call->cbid, &name);
      recorded.host_calls.push_back(
          {.name = name, .thread = call->threadId, .start_ns = call->start, .end_ns = call->end});
    }
  }
  std::free(buffer);
}

absl::Status CuptiStatus(CUptiResult result, std::string_view what) {
  if (result == CUPTI_SUCCESS) return absl::OkStatus();
  const char* message = "unknown error";
  cuptiGetResultString(result, &message);
  return absl::InternalError(absl::StrCat("CUPTI: ", AbslView(what), ": ", message));
}

}  // namespace

absl::Status StartTimeline() {
  TTT_RETURN_IF_ERROR(CuptiStatus(cuptiActivityRegisterCallbacks(BufferRequested, BufferCompleted),
                                  "cuptiActivityRegisterCallbacks"));
  for (const CUpti_ActivityKind kind : {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                        CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER}) {
    TTT_RETURN_IF_ERROR(CuptiStatus(cuptiActivityEnable(kind), "cuptiActivityEnable"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Timeline> TakeTimeline() {
  if (const cudaError_t error = cudaDeviceSynchronize(); error != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaDeviceSynchronize: ", cudaGetErrorString(error)));
  }
  TTT_RETURN_IF_ERROR(CuptiStatus(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED),
                                  "cuptiActivityFlushAll"));
  std::lock_guard lock(recorded_mutex);
  return std::exchange(recorded, {});
}

}  // namespace ttt
