#include "server/engine/engine.h"

#include "absl/strings/str_cat.h"
#include "server/util/status_macros.h"

namespace ttt {

absl::Status ValidateBatchSampling(std::span<const SequenceChunk> batch,
                                   std::span<const SamplingParams> sampling) {
  if (sampling.size() != batch.size()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling: ", sampling.size(),
                                                   " entries for a batch of ", batch.size()));
  }
  for (size_t i = 0; i < sampling.size(); ++i) {
    const SamplingParams& p = sampling[i];
    const absl::Status valid = ValidateSamplingParams(p);
    if (!valid.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("sampling[", i, "].", valid.message()));
    }
    if (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f ||
        p.frequency_penalty != 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling[", i, "]: penalties need the token history; apply them to Forward's logits"));
    }
  }
  return absl::OkStatus();
}

}  // namespace ttt
