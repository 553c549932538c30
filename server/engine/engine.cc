#include "server/engine/engine.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "server/util/status_macros.h"

namespace ttt {

absl::Status ValidateBatch(
    std::span<const SequenceChunk> batch, LogitsFor which, int64_t vocab_size,
    const std::function<absl::Status(SequenceSlot, std::string_view)>& check_slot) {
  absl::flat_hash_set<SequenceSlot> seen;
  for (size_t b = 0; b < batch.size(); ++b) {
    const SequenceChunk& chunk = batch[b];
    TTT_RETURN_IF_ERROR(check_slot(chunk.slot, absl::StrCat("batch[", b, "].slot")));
    if (!seen.insert(chunk.slot).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch[", b, "].slot: slot ", chunk.slot, " appears twice in one batch"));
    }
    if (which == LogitsFor::kLastToken && chunk.tokens.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("batch[", b, "].tokens: empty, so it has no last token to give logits for"));
    }
    for (size_t i = 0; i < chunk.tokens.size(); ++i) {
      if (chunk.tokens[i] < 0 || chunk.tokens[i] >= vocab_size) {
        return absl::InvalidArgumentError(
            absl::StrCat("batch[", b, "].tokens[", i, "]: id ", chunk.tokens[i],
                         " is outside the vocabulary [0, ", vocab_size, ")"));
      }
    }
  }
  return absl::OkStatus();
}

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
