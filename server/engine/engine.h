// The backend-neutral engine: per-sequence TTT states addressed by slot, advanced by feeding
// tokens.
//
// A sequence's state has a fixed size whatever its length (θ0 per layer and head, the open
// mini-batch window's pending tokens, conv histories): that is what makes fork, snapshot and
// resume one copy each. Every backend (CPU here, CUDA later) implements this interface and computes
// the same function, so tests and the server run unchanged on either.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/engine/sampler.h"
#include "server/model/config.h"

namespace ttt {

// A sequence's state slot. Slots stay put while others come and go.
using SequenceSlot = int32_t;

// Tokens to append to one sequence, after everything it has absorbed.
struct SequenceChunk {
  SequenceSlot slot = -1;
  std::span<const int32_t> tokens;
  // Instead of `tokens` (left empty): the one token that the step in flight chooses for this
  // sequence (see StartForwardAndSample). It passes from that step to this one on the device.
  bool takes_token_in_flight = false;

  size_t length() const { return takes_token_in_flight ? 1 : tokens.size(); }
};

enum class LogitsFor {
  kNone,        // Only advance the states (prefill that needs no output).
  kLastToken,   // One row per chunk: the logits after its last token.
  kEveryToken,  // One row per token, chunks in order.
};

class Engine {
 public:
  virtual ~Engine() = default;

  virtual const ModelConfig& config() const = 0;
  virtual std::string_view backend() const = 0;
  // Bytes of one sequence's state.
  virtual size_t state_bytes() const = 0;
  // Bytes of the weights as this backend holds them.
  virtual size_t weight_bytes() const = 0;
  // The most sequences alive at once (0: no limit but memory).
  virtual int64_t max_sequences() const = 0;

  // A fresh sequence: θ0 from the checkpoint, nothing absorbed.
  virtual absl::StatusOr<SequenceSlot> CreateSequence() = 0;
  virtual absl::Status ReleaseSequence(SequenceSlot slot) = 0;
  // A new sequence whose state is a copy of `source`'s: both then continue independently.
  virtual absl::StatusOr<SequenceSlot> ForkSequence(SequenceSlot source) = 0;
  // Tokens absorbed so far.
  virtual absl::StatusOr<int64_t> SequenceLength(SequenceSlot slot) const = 0;

  // The state as versioned bytes naming the model it belongs to (see state_codec.h).
  virtual absl::StatusOr<std::string> SaveSequence(SequenceSlot slot) const = 0;
  // A new sequence from SaveSequence's bytes; bytes of another model or corrupt bytes are refused.
  virtual absl::StatusOr<SequenceSlot> RestoreSequence(std::string_view bytes) = 0;

  // Feeds every chunk's tokens to its sequence: prefill and decode alike (decode is one token per
  // chunk), sequences at any offsets, in one batch. Chunks must name distinct live slots and
  // tokens must lie in [0, vocab_size); kLastToken needs every chunk non-empty. Inputs are checked
  // before any state changes, so a bad call leaves every sequence as it was. Writes
  // rows × vocab_size floats to *logits as `which` says.
  virtual absl::Status Forward(std::span<const SequenceChunk> batch, LogitsFor which,
                               std::vector<float>* logits) = 0;

  // Forward with kLastToken, then each sequence's next token chosen from those logits as
  // SampleToken does, with one SamplingParams per chunk and the sequence's new length as the draw
  // counter. Penalties need the caller's token history, so a non-default penalty here is
  // InvalidArgument (apply them to Forward's logits instead). On a GPU only ids and log-probs
  // leave the device.
  virtual absl::Status ForwardAndSample(std::span<const SequenceChunk> batch,
                                        std::span<const SamplingParams> sampling,
                                        std::vector<SampledToken>* tokens) = 0;

  // ForwardAndSample in two halves, so that the caller can prepare the next step while the
  // device computes this one. StartForwardAndSample checks the batch as ForwardAndSample does and
  // queues the step; from then on its sequences count as advanced (SequenceLength includes it).
  // FinishForwardAndSample waits for the oldest step in flight and returns its tokens.
  // Up to kMaxStepsInFlight steps are in flight: a Start while one is in flight queues behind it,
  // and its chunks may take the tokens that step chooses (SequenceChunk::takes_token_in_flight),
  // so the device goes from step to step without waiting for tokens to reach the host and come
  // back. Until steps are finished, calls on sequences (create, release, fork, save, restore) are
  // ordered after them, and Forward, ForwardAndSample and a Start past the limit are
  // FailedPrecondition. Backends that compute synchronously keep this default: Start computes
  // (with the tokens in flight already on the host), Finish hands over.
  static constexpr int kMaxStepsInFlight = 2;
  virtual absl::Status StartForwardAndSample(std::span<const SequenceChunk> batch,
                                             std::span<const SamplingParams> sampling);
  virtual absl::Status FinishForwardAndSample(std::vector<SampledToken>* tokens);
  // The device's time on the latest step collected (by Forward, ForwardAndSample or
  // FinishForwardAndSample), from its first operation on the device to its last; absent where
  // the backend does not measure it.
  virtual std::optional<absl::Duration> CollectedStepDeviceTime() const { return std::nullopt; }
  // Whether the latest step collected ran as a graph captured before it (a launch for the whole
  // step); absent where the backend does not capture steps.
  virtual std::optional<bool> CollectedStepReplayedGraph() const { return std::nullopt; }
  // How a decode step of a single sequence runs, and why, where the backend has more than one
  // way (for the server's log and benchmark records); empty elsewhere.
  virtual std::string single_sequence_decode() const { return {}; }
  // What the backend prepared at start for the steps it expects (graphs captured, and what they
  // cost), for the server's log and benchmark records; empty where it prepares nothing.
  virtual std::string preparation() const { return {}; }

 protected:
  // Whether the default Start has results that Finish has not taken, and is not computing
  // another (which runs through the backend's own ForwardAndSample).
  bool default_step_in_flight() const { return !started_steps_.empty() && !computing_step_; }

 private:
  // A step the default Start computed, until Finish takes it.
  struct StartedStep {
    std::vector<SequenceSlot> slots;
    std::vector<SampledToken> tokens;  // One per slot.
    std::optional<int32_t> TokenFor(SequenceSlot slot) const;
  };
  std::deque<StartedStep> started_steps_;
  bool computing_step_ = false;
};

// The checks every backend's Forward makes before touching any state: every slot holds a live
// sequence (`is_live`; NotFound otherwise), slots are distinct, tokens inside [0, vocab_size),
// and chunks non-empty when kLastToken wants logits. A chunk that takes the token in flight has no
// tokens of its own, and the step in flight must choose one for its slot (`chosen_in_flight`; a
// null one means no step is in flight). Errors name the field (batch[i].slot, ...).
absl::Status ValidateBatch(std::span<const SequenceChunk> batch, LogitsFor which,
                           int64_t vocab_size, const std::function<bool(SequenceSlot)>& is_live,
                           const std::function<bool(SequenceSlot)>& chosen_in_flight = nullptr);

// The checks ForwardAndSample makes on `sampling` besides Forward's on `batch`.
absl::Status ValidateBatchSampling(std::span<const SequenceChunk> batch,
                                   std::span<const SamplingParams> sampling);

// The FailedPrecondition errors of the two-halves protocol.
absl::Status StepInFlightError();
absl::Status NoStepInFlightError();
// The InvalidArgument errors of a chunk b that takes the token in flight.
absl::Status TakesTokenWithTokensError(size_t b);
absl::Status NoTokenInFlightError(size_t b, SequenceSlot slot);

}  // namespace ttt
