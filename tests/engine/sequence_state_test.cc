// Forking, saving and restoring sequence states; slot bookkeeping; W1 in halves; the conv
// histories as rings.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "server/engine/cpu_engine.h"
#include "server/engine/state_layout.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

class SequenceStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = LoadModel(testing::TestDataPath("golden/tiny-mlp-m"));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *model;
    engine_ = std::make_unique<CpuEngine>(model_);
    for (int32_t i = 0; i < 64; ++i) tokens_.push_back((i * 37 + 11) % 512);
  }

  std::vector<float> Feed(SequenceSlot slot, std::span<const int32_t> tokens) {
    std::vector<float> logits;
    const SequenceChunk chunk{slot, tokens};
    EXPECT_TRUE(engine_->Forward({&chunk, 1}, LogitsFor::kEveryToken, &logits).ok());
    return logits;
  }

  std::shared_ptr<const Model> model_;
  std::unique_ptr<CpuEngine> engine_;
  std::vector<int32_t> tokens_;
};

TEST_F(SequenceStateTest, ForkContinuesExactlyLikeTheOriginal) {
  const std::span<const int32_t> all(tokens_);
  const SequenceSlot original = *engine_->CreateSequence();
  Feed(original, all.first(21));  // Mid-window, so pending tokens must be copied too.
  const SequenceSlot fork = *engine_->ForkSequence(original);
  EXPECT_EQ(*engine_->SequenceLength(fork), 21);
  const std::vector<float> from_fork = Feed(fork, all.subspan(21));
  const std::vector<float> from_original = Feed(original, all.subspan(21));
  EXPECT_EQ(from_fork, from_original);  // Bit for bit.
}

TEST_F(SequenceStateTest, ForkIsIndependentOfTheOriginal) {
  const std::span<const int32_t> all(tokens_);
  const SequenceSlot original = *engine_->CreateSequence();
  Feed(original, all.first(10));
  const SequenceSlot fork = *engine_->ForkSequence(original);
  Feed(original, all.subspan(30, 20));  // Moves the original elsewhere.
  const std::vector<float> from_fork = Feed(fork, all.subspan(10, 20));

  const SequenceSlot reference = *engine_->CreateSequence();
  Feed(reference, all.first(10));
  EXPECT_EQ(from_fork, Feed(reference, all.subspan(10, 20)));
}

TEST_F(SequenceStateTest, SaveRestoreContinuesBitIdentically) {
  const std::span<const int32_t> all(tokens_);
  const SequenceSlot slot = *engine_->CreateSequence();
  Feed(slot, all.first(37));
  auto saved = engine_->SaveSequence(slot);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_GT(saved->size(), engine_->state_bytes());

  // Restored into a different engine instance, as after a server restart.
  CpuEngine other(model_);
  auto restored = other.RestoreSequence(*saved);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(*other.SequenceLength(*restored), 37);
  std::vector<float> from_restored;
  const SequenceChunk chunk{*restored, all.subspan(37)};
  ASSERT_TRUE(other.Forward({&chunk, 1}, LogitsFor::kEveryToken, &from_restored).ok());
  EXPECT_EQ(from_restored, Feed(slot, all.subspan(37)));
}

TEST_F(SequenceStateTest, StateOfAnotherModelIsRefused) {
  const SequenceSlot slot = *engine_->CreateSequence();
  Feed(slot, std::span(tokens_).first(5));
  const std::string saved = *engine_->SaveSequence(slot);

  auto linear = LoadModel(testing::TestDataPath("golden/tiny-linear-m"));
  ASSERT_TRUE(linear.ok());
  CpuEngine linear_engine(*linear);
  auto restored = linear_engine.RestoreSequence(saved);
  EXPECT_EQ(restored.status().code(), absl::StatusCode::kFailedPrecondition) << restored.status();
  EXPECT_NE(restored.status().message().find("tiny-mlp-m"), std::string_view::npos)
      << restored.status();

  // Same config, different weights: still another model.
  ModelConfig config = model_->config;
  CpuEngine lookalike(testing::RandomModel(config, 5, "tiny-mlp-m"));
  EXPECT_EQ(lookalike.RestoreSequence(saved).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(SequenceStateTest, CorruptOrTruncatedStateIsRefused) {
  const SequenceSlot slot = *engine_->CreateSequence();
  Feed(slot, std::span(tokens_).first(5));
  const std::string saved = *engine_->SaveSequence(slot);

  std::string flipped = saved;
  flipped[flipped.size() / 2] ^= 0x40;
  EXPECT_EQ(engine_->RestoreSequence(flipped).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (size_t keep : {size_t{0}, size_t{7}, size_t{30}, saved.size() - 1}) {
    EXPECT_EQ(engine_->RestoreSequence(saved.substr(0, keep)).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "truncated to " << keep << " bytes";
  }
  EXPECT_EQ(engine_->RestoreSequence(saved + "x").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SequenceStateTest, ReleasedSlotsAreGoneAndReused) {
  const SequenceSlot a = *engine_->CreateSequence();
  const SequenceSlot b = *engine_->CreateSequence();
  Feed(a, std::span(tokens_).first(3));
  ASSERT_TRUE(engine_->ReleaseSequence(a).ok());
  EXPECT_EQ(engine_->SequenceLength(a).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->ReleaseSequence(a).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->ForkSequence(a).status().code(), absl::StatusCode::kNotFound);
  // A reused slot starts fresh.
  const SequenceSlot c = *engine_->CreateSequence();
  EXPECT_EQ(c, a);
  EXPECT_EQ(*engine_->SequenceLength(c), 0);
  EXPECT_EQ(Feed(c, std::span(tokens_).first(3)), Feed(b, std::span(tokens_).first(3)));
}

TEST_F(SequenceStateTest, SlotLimitIsResourceExhausted) {
  CpuEngine limited(model_, {.max_sequences = 2});
  const SequenceSlot a = *limited.CreateSequence();
  ASSERT_TRUE(limited.CreateSequence().ok());
  EXPECT_EQ(limited.CreateSequence().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(limited.ForkSequence(a).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(limited.ReleaseSequence(a).ok());
  EXPECT_TRUE(limited.CreateSequence().ok());
}

// W1 in halves (the CUDA engine's, with bf16 weights): the first half of each layer's W1 holds
// every float's upper 16 bits, the second its lower 16, and joined they are the floats to the
// bit, the rest of the state untouched.
TEST(StateLayoutTest, W1InHalvesJoinsBackToTheSameBits) {
  auto model = LoadModel(testing::TestDataPath("golden/tiny-linear-m"));
  ASSERT_TRUE(model.ok()) << model.status();
  const StateLayout layout((*model)->config);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  std::vector<float> state(layout.total_floats());
  for (float& v : state) v = normal(rng);
  const std::vector<float> original = state;

  SplitW1(layout, state);
  const size_t n = layout.W1_floats;
  for (int64_t layer = 0; layer < layout.num_layers; ++layer) {
    const size_t at = layout.layer_offset(layer) + layout.W1;
    std::vector<uint16_t> halves(2 * n);
    std::memcpy(halves.data(), state.data() + at, 2 * n * sizeof(uint16_t));
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &original[at + i], sizeof(bits));
      ASSERT_EQ(halves[i], bits >> 16) << "layer " << layer << ", W1 element " << i;
      ASSERT_EQ(halves[n + i], bits & 0xffffu) << "layer " << layer << ", W1 element " << i;
    }
    EXPECT_TRUE(std::equal(state.begin() + at + n, state.begin() + layout.layer_offset(layer + 1),
                           original.begin() + at + n))
        << "layer " << layer << ": the state past W1 changed";
  }
  JoinW1(layout, state);
  EXPECT_EQ(std::memcmp(state.data(), original.data(), state.size() * sizeof(float)), 0);
}

// The conv histories as rings (the CUDA engine's): after `length` tokens, the input at position
// s sits in row s mod (ck − 1) of each history, the rest of the state untouched, and ordering
// them again gives the saved form back, for every length modulo ck − 1.
TEST(StateLayoutTest, ConvHistoriesAsRingsOrderBackToTheSavedForm) {
  auto model = LoadModel(testing::TestDataPath("golden/tiny-linear-m"));
  ASSERT_TRUE(model.ok()) << model.status();
  const StateLayout layout((*model)->config);
  const size_t rows = layout.conv_history_rows, width = layout.conv_history_width;
  ASSERT_EQ(rows, 3u);
  ASSERT_EQ(layout.conv_histories.size(), 2u);  // The pre-conv's and q/k's.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> saved(layout.total_floats());
  for (float& v : saved) v = normal(rng);
  for (const int64_t length : {0, 1, 2, 3, 19, 20, 1000}) {
    SCOPED_TRACE(absl::StrCat("length ", length));
    std::vector<float> state = saved;
    RingConvHistories(layout, length, state);
    std::vector<float> expected = saved;
    for (int64_t layer = 0; layer < layout.num_layers; ++layer) {
      for (size_t offset : layout.conv_histories) {
        const size_t at = layout.layer_offset(layer) + offset;
        for (size_t i = 0; i < rows; ++i) {
          // Saved row i holds position length − rows + i.
          const int64_t position = length - static_cast<int64_t>(rows) + static_cast<int64_t>(i);
          const size_t ring_row = static_cast<size_t>((position % 3 + 3) % 3);
          std::copy_n(saved.begin() + at + i * width, width,
                      expected.begin() + at + ring_row * width);
        }
      }
    }
    EXPECT_EQ(state, expected);
    OrderConvHistories(layout, length, state);
    EXPECT_EQ(state, saved);
  }
}

}  // namespace
}  // namespace ttt
