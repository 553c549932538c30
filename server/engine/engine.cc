#include "server/engine/engine.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/util/status_macros.h"

namespace ttt {

absl::Status Engine::StartForwardAndSample(std::span<const SequenceChunk> batch,
                                           std::span<const SamplingParams> sampling) {
  if (started_steps_.size() >= kMaxStepsInFlight) return StepInFlightError();
  // The tokens the newest step in flight chose are on the host already: feed them as tokens.
  std::vector<SequenceChunk> resolved(batch.begin(), batch.end());
  std::vector<int32_t> taken(batch.size());
  for (size_t b = 0; b < batch.size(); ++b) {
    if (!batch[b].takes_token_in_flight) continue;
    if (!batch[b].tokens.empty()) return TakesTokenWithTokensError(b);
    const std::optional<int32_t> token =
        started_steps_.empty() ? std::nullopt : started_steps_.back().TokenFor(batch[b].slot);
    if (!token.has_value()) return NoTokenInFlightError(b, batch[b].slot);
    taken[b] = *token;
    resolved[b] = {batch[b].slot, std::span(&taken[b], 1)};
  }
  StartedStep step;
  computing_step_ = true;
  const absl::Status computed = ForwardAndSample(resolved, sampling, &step.tokens);
  computing_step_ = false;
  TTT_RETURN_IF_ERROR(computed);
  for (const SequenceChunk& chunk : batch) step.slots.push_back(chunk.slot);
  started_steps_.push_back(std::move(step));
  return absl::OkStatus();
}

std::optional<int32_t> Engine::StartedStep::TokenFor(SequenceSlot slot) const {
  const auto at = std::find(slots.begin(), slots.end(), slot);
  if (at == slots.end()) return std::nullopt;
  return tokens[at - slots.begin()].id;
}

absl::Status Engine::FinishForwardAndSample(std::vector<SampledToken>* tokens) {
  if (started_steps_.empty()) return NoStepInFlightError();
  *tokens = std::move(started_steps_.front().tokens);
  started_steps_.pop_front();
  return absl::OkStatus();
}

absl::Status StepInFlightError() {
  return absl::FailedPreconditionError(
      "a step is in flight: FinishForwardAndSample must collect it first");
}

absl::Status NoStepInFlightError() {
  return absl::FailedPreconditionError("no step in flight: StartForwardAndSample starts one");
}

absl::Status TakesTokenWithTokensError(size_t b) {
  return absl::InvalidArgumentError(absl::StrCat(
      "batch[", b, "].tokens: must be empty when the chunk takes the token in flight"));
}

absl::Status NoTokenInFlightError(size_t b, SequenceSlot slot) {
  return absl::InvalidArgumentError(absl::StrCat(
      "batch[", b, "].takes_token_in_flight: no step in flight chooses a token for slot ", slot));
}

absl::Status ValidateBatch(std::span<const SequenceChunk> batch, LogitsFor which,
                           int64_t vocab_size, const std::function<bool(SequenceSlot)>& is_live,
                           const std::function<bool(SequenceSlot)>& chosen_in_flight) {
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
    if (chunk.takes_token_in_flight) {
      if (!chunk.tokens.empty()) return TakesTokenWithTokensError(b);
      if (chosen_in_flight == nullptr || !chosen_in_flight(chunk.slot)) {
        return NoTokenInFlightError(b, chunk.slot);
      }
    }
    if (which == LogitsFor::kLastToken && chunk.length() == 0) {
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
