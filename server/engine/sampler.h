// Choosing the next token from a row of logits: greedy or sampled, reproducibly.
#pragma once

#include <cstdint>
#include <span>

#include "absl/status/status.h"

namespace ttt {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax); otherwise logits are divided by it.
  int32_t top_k = 0;         // Keep the k most likely tokens; 0: all.
  float top_p = 1.0f;        // Keep the smallest set whose probability reaches top_p.
  float min_p = 0.0f;        // Drop tokens below min_p × the most likely token's probability.
  // Penalties on tokens already seen, with vLLM's meaning: repetition (> 1 discourages) applies to
  // prompt and output tokens; presence and frequency subtract from the logits of output tokens.
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
};

// InvalidArgument naming the field when a value is out of range.
absl::Status ValidateSamplingParams(const SamplingParams& params);

struct SampledToken {
  int32_t id = 0;
  float logprob = 0.0f;  // log-softmax of the model's raw logits at id.
};

// Picks a token from `logits` [vocab]. `prompt` and `output` are the sequence's tokens so far (for
// the penalties). The kept set: of the top-k tokens, the nucleus that reaches top_p of their
// probability and those at least min_p as likely as the most likely (both), where top-k and top-p
// rank tokens by their tempered scores (l − max)·(1/T) in float and keep every token tied with the
// last they keep; the draw walks them in id order with u = a counter-based random number of
// (seed, step), so a request replays exactly. `step` is the sequence's length when the token is
// chosen.
SampledToken SampleToken(std::span<const float> logits, const SamplingParams& params,
                         std::span<const int32_t> prompt, std::span<const int32_t> output,
                         uint64_t step);

}  // namespace ttt
