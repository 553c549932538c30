// The engine on the CPU, in float32: the reference backend every other one is checked against.
#pragma once

#include <memory>
#include <vector>

#include "server/engine/engine.h"
#include "server/engine/state_layout.h"
#include "server/model/model.h"

namespace ttt {

struct CpuEngineOptions {
  // The most sequences alive at once; 0 means no limit but memory.
  int64_t max_sequences = 0;
};

class CpuEngine : public Engine {
 public:
  CpuEngine(std::shared_ptr<const Model> model, CpuEngineOptions options = {});

  const ModelConfig& config() const override { return model_->config; }
  std::string_view backend() const override { return "cpu"; }
  size_t state_bytes() const override { return layout_.total_bytes(); }
  size_t weight_bytes() const override { return model_->weights.total_bytes(); }
  int64_t max_sequences() const override { return options_.max_sequences; }

  absl::StatusOr<SequenceSlot> CreateSequence() override;
  absl::Status ReleaseSequence(SequenceSlot slot) override;
  absl::StatusOr<SequenceSlot> ForkSequence(SequenceSlot source) override;
  absl::StatusOr<int64_t> SequenceLength(SequenceSlot slot) const override;
  absl::StatusOr<std::string> SaveSequence(SequenceSlot slot) const override;
  absl::StatusOr<SequenceSlot> RestoreSequence(std::string_view bytes) override;
  absl::Status Forward(std::span<const SequenceChunk> batch, LogitsFor which,
                       std::vector<float>* logits) override;
  absl::Status ForwardAndSample(std::span<const SequenceChunk> batch,
                                std::span<const SamplingParams> sampling,
                                std::vector<SampledToken>* tokens) override;

 private:
  struct Sequence {
    std::vector<float> state;  // StateLayout order.
    int64_t length = 0;        // Tokens absorbed.
  };
  // A chunk's place in the batch's stacked activations.
  struct Segment {
    Sequence* sequence;
    int64_t row;    // First row in the stacked [rows, D] activations.
    int64_t count;  // Tokens.
  };

  absl::StatusOr<SequenceSlot> AddSequence(Sequence sequence);
  absl::StatusOr<Sequence*> Find(SequenceSlot slot, std::string_view field);
  absl::StatusOr<const Sequence*> Find(SequenceSlot slot, std::string_view field) const;
  absl::Status Validate(std::span<const SequenceChunk> batch, LogitsFor which) const;
  // Runs layer `layer` over every segment, updating the hidden states h [rows, D] in place.
  void ForwardLayer(int64_t layer, std::span<const Segment> segments, int64_t rows,
                    std::vector<float>& h);

  std::shared_ptr<const Model> model_;
  CpuEngineOptions options_;
  StateLayout layout_;
  // One layer's weights, looked up by name once at construction rather than on every step.
  struct LayerWeights {
    const float *conv_norm = nullptr, *conv_w = nullptr, *conv_b = nullptr;  // pre_conv
    const float *seq_norm, *q_proj, *k_proj = nullptr, *v_proj, *o_proj, *g_proj = nullptr;
    const float *conv_q_w = nullptr, *conv_q_b = nullptr, *conv_k_w = nullptr, *conv_k_b = nullptr;
    const float *lr_w, *lr_b, *ttt_norm_w, *ttt_norm_b, *post_norm_w, *post_norm_b;
    const float *ffn_norm, *gate_proj, *up_proj, *down_proj;
    std::vector<float> tau;  // τ_r = max(0, 1/(r+1) + c_r).
  };

  std::vector<float> fresh_state_;  // θ0 from the checkpoint, everything else zero.
  std::vector<LayerWeights> layers_;
  const float *embedding_, *final_norm_, *lm_head_;
  std::vector<std::unique_ptr<Sequence>> slots_;  // nullptr: free.
  std::vector<SequenceSlot> free_slots_;
  int64_t live_sequences_ = 0;
};

}  // namespace ttt
