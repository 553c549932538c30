#include "server/engine/engine.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/util/status_macros.h"

namespace ttt {

absl::Status Engine::StartForwardAndSample(std::span<const SequenceChunk> batch,
                                           std::span<const SamplingParams> sampling) {
  if (started_step_.has_value()) return StepInFlightError();
  std::vector<SampledToken> tokens;
  TTT_RETURN_IF_ERROR(ForwardAndSample(batch, sampling, &tokens));
  started_step_ = std::move(tokens);
  return absl::OkStatus();
}

absl::Status Engine::FinishForwardAndSample(std::vector<SampledToken>* tokens) {
  if (!started_step_.has_value()) return NoStepInFlightError();
  *tokens = *std::exchange(started_step_, std::nullopt);
  return absl::OkStatus();
}

absl::Status StepInFlightError() {
  return absl::FailedPreconditionError(
      "a step is in flight: FinishForwardAndSample must collect it first");
}

absl::Status NoStepInFlightError() {
  return absl::FailedPreconditionError("no step in flight: StartForwardAndSample starts one");
}

absl::Status ValidateBatch(std::span<const SequenceChunk> batch, LogitsFor which,
                           int64_t vocab_size,
                           const std::function<bool(SequenceSlot)>& is_live) {
  // Runs on every engine step: nothing is allocated per chunk unless there is an error.
  std::vector<SequenceSlot> slots;
  slots.reserve(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    const SequenceChunk& chunk = batch[b];
    if (!is_live(chunk.slot)) {
      return absl::NotFoundError(
          absl::StrCat("batch[", b, "].slot: no sequence in slot ", chunk.slot));
    }
    slots.push_back(chunk.slot);
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
  std::sort(slots.begin(), slots.end());
  if (auto twice = std::adjacent_find(slots.begin(), slots.end()); twice != slots.end()) {
    bool seen = false;  // Name the second chunk that has it.
    for (size_t b = 0; b < batch.size(); ++b) {
      if (batch[b].slot != *twice) continue;
      if (seen) {
        return absl::InvalidArgumentError(
            absl::StrCat("batch[", b, "].slot: slot ", *twice, " appears twice in one batch"));
      }
      seen = true;
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
