// On random models of every shape the spec allows, per-token decode equals one-shot prefill, and a
// batch mixing sequences at different offsets equals running each alone.
#include <random>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "server/engine/cpu_engine.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

struct Variant {
  int64_t head_dim;
  TttLayerType inner;
  bool share_qk, use_gate, pre_conv;
};

std::string VariantName(const Variant& v) {
  return absl::StrCat("f", v.head_dim, v.inner == TttLayerType::kMlp ? "_mlp" : "_linear",
                      v.share_qk ? "_shareqk" : "", v.use_gate ? "_gate" : "",
                      v.pre_conv ? "_preconv" : "");
}

void PrintTo(const Variant& v, std::ostream* os) { *os << VariantName(v); }

std::vector<Variant> AllVariants() {
  std::vector<Variant> variants;
  for (int64_t f : {16, 32, 64, 96}) {
    for (TttLayerType inner : {TttLayerType::kLinear, TttLayerType::kMlp}) {
      for (int flags = 0; flags < 8; ++flags) {
        variants.push_back({f, inner, bool(flags & 1), bool(flags & 2), bool(flags & 4)});
      }
    }
  }
  return variants;
}

class DecodeEqualsPrefillTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    const Variant& v = GetParam();
    ModelConfig c;
    c.vocab_size = 97;
    c.num_attention_heads = 2;
    c.hidden_size = 2 * v.head_dim;
    c.intermediate_size = 40;
    c.num_hidden_layers = 2;
    c.ttt_layer_type = v.inner;
    c.ttt_base_lr = v.inner == TttLayerType::kMlp ? 0.1 : 1.0;
    c.share_qk = v.share_qk;
    c.use_gate = v.use_gate;
    c.pre_conv = v.pre_conv;
    c.tie_word_embeddings = v.head_dim % 32 == 0;  // Half the variants tied, half not.
    model_ = testing::RandomModel(c, /*seed=*/v.head_dim * 16 + v.share_qk);
    std::mt19937 rng(v.head_dim);
    std::uniform_int_distribution<int32_t> token(0, c.vocab_size - 1);
    tokens_.resize(200);
    for (int32_t& t : tokens_) t = token(rng);
  }

  std::vector<float> Feed(std::vector<int64_t> chunk_sizes, int64_t count) {
    CpuEngine engine(model_);
    const SequenceSlot slot = *engine.CreateSequence();
    return testing::FeedInChunks(engine, slot, std::span(tokens_).first(count), chunk_sizes);
  }

  std::shared_ptr<const Model> model_;
  std::vector<int32_t> tokens_;
};

// The scale of the logits, so the tolerance is relative to what the model outputs.
float MaxAbs(std::span<const float> values) {
  float m = 0;
  for (float v : values) m = std::max(m, std::abs(v));
  return m;
}

TEST_P(DecodeEqualsPrefillTest, TokenByTokenEqualsWholePrompt) {
  const std::vector<float> prefill = Feed({200}, 200);
  const std::vector<float> decode = Feed({1}, 200);
  const std::vector<float> chunked = Feed({7, 16, 1, 33, 5}, 200);
  const float tolerance = 2e-5f * std::max(1.0f, MaxAbs(prefill));
  EXPECT_LE(testing::MaxAbsDiff(decode, prefill), tolerance);
  EXPECT_LE(testing::MaxAbsDiff(chunked, prefill), tolerance);
}

TEST_P(DecodeEqualsPrefillTest, MixedOffsetBatchEqualsEachAlone) {
  // Four sequences with different prompt lengths (so different window offsets), advanced
  // together by one Forward per step: first their prompts, then 40 tokens each, one per step.
  const std::vector<int64_t> prompt_lengths = {1, 15, 16, 37};
  const int64_t steps = 40;
  CpuEngine engine(model_);
  std::vector<SequenceSlot> slots;
  std::vector<SequenceChunk> batch;
  std::vector<std::vector<int32_t>> own(prompt_lengths.size());
  for (size_t s = 0; s < prompt_lengths.size(); ++s) {
    // Each sequence reads the shared token stream from its own starting point.
    own[s].assign(tokens_.begin() + 3 * s, tokens_.begin() + 3 * s + prompt_lengths[s] + steps);
    slots.push_back(*engine.CreateSequence());
    batch.push_back({slots[s], std::span(own[s]).first(prompt_lengths[s])});
  }
  std::vector<float> logits;
  ASSERT_TRUE(engine.Forward(batch, LogitsFor::kNone, &logits).ok());
  std::vector<std::vector<float>> batched(prompt_lengths.size());
  for (int64_t step = 0; step < steps; ++step) {
    for (size_t s = 0; s < batch.size(); ++s) {
      batch[s].tokens = std::span(own[s]).subspan(prompt_lengths[s] + step, 1);
    }
    ASSERT_TRUE(engine.Forward(batch, LogitsFor::kLastToken, &logits).ok());
    for (size_t s = 0; s < batch.size(); ++s) {
      const int64_t V = model_->config.vocab_size;
      batched[s].insert(batched[s].end(), logits.begin() + s * V, logits.begin() + (s + 1) * V);
    }
  }
  for (size_t s = 0; s < prompt_lengths.size(); ++s) {
    CpuEngine alone(model_);
    const std::vector<float> all =
        testing::FeedInChunks(alone, *alone.CreateSequence(), own[s], {int64_t(own[s].size())});
    const std::span<const float> tail =
        std::span(all).last(steps * model_->config.vocab_size);
    EXPECT_LE(testing::MaxAbsDiff(batched[s], tail), 2e-5f * std::max(1.0f, MaxAbs(tail)))
        << "sequence with prompt length " << prompt_lengths[s];
  }
}

INSTANTIATE_TEST_SUITE_P(EveryShape, DecodeEqualsPrefillTest, ::testing::ValuesIn(AllVariants()),
                         [](const auto& info) { return VariantName(info.param); });

}  // namespace
}  // namespace ttt
