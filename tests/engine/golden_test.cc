// The CPU engine against the reference implementation's outputs on every golden model.
#include <cstdio>
#include <random>

#include <gtest/gtest.h>

#include "server/engine/cpu_engine.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using testing::Golden;

constexpr float kTolerance = 1e-3f;  // Max-abs on logits (tests/data/golden/README.md).

class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto model = LoadModel(testing::TestDataPath("golden/" + GetParam()));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *model;
    golden_ = testing::LoadGolden(GetParam());
    ASSERT_GT(golden_.batch, 0);
    ASSERT_EQ(golden_.vocab, model_->config.vocab_size);
  }

  // Feeds each prompt with the given chunk sizes and checks every position's logits against
  // both reference passes; prints the largest differences seen.
  void ExpectMatchesReference(const std::string& chunking,
                              const std::vector<std::vector<int64_t>>& chunk_sizes_per_row) {
    CpuEngine engine(model_);
    float worst_prefill = 0, worst_decode = 0;
    for (int64_t b = 0; b < golden_.batch; ++b) {
      auto slot = engine.CreateSequence();
      ASSERT_TRUE(slot.ok());
      const std::vector<float> logits =
          testing::FeedInChunks(engine, *slot, golden_.input_ids[b], chunk_sizes_per_row[b]);
      ASSERT_EQ(logits.size(), size_t(golden_.length * golden_.vocab));
      for (int64_t t = 0; t < golden_.length; ++t) {
        std::span<const float> row = std::span(logits).subspan(t * golden_.vocab, golden_.vocab);
        worst_prefill = std::max(
            worst_prefill,
            testing::MaxAbsDiff(row, golden_.Row(golden_.prefill_logits, b, t, golden_.length)));
        worst_decode = std::max(
            worst_decode,
            testing::MaxAbsDiff(row, golden_.Row(golden_.decode_logits, b, t, golden_.length)));
      }
    }
    std::printf("[golden] %-16s %-22s max|Δ| vs prefill_logits %.3g, vs decode_logits %.3g\n",
                GetParam().c_str(), chunking.c_str(), worst_prefill, worst_decode);
    EXPECT_LE(worst_prefill, kTolerance) << chunking;
    EXPECT_LE(worst_decode, kTolerance) << chunking;
  }

  std::shared_ptr<const Model> model_;
  Golden golden_;
};

TEST_P(GoldenTest, WholePromptAtOnce) {
  ExpectMatchesReference("whole prompt", {{golden_.length}, {golden_.length}});
}

TEST_P(GoldenTest, OneTokenAtATime) { ExpectMatchesReference("token by token", {{1}, {1}}); }

TEST_P(GoldenTest, ReferenceDecodeSplit) {
  // As the reference's decode pass: prefill_len tokens, then one per call.
  std::vector<int64_t> sizes = {golden_.prefill_len};
  sizes.resize(golden_.length - golden_.prefill_len + 1, 1);
  ExpectMatchesReference("prefill_len then 1s", {sizes, sizes});
}

TEST_P(GoldenTest, RandomChunkings) {
  std::mt19937 rng(2024);
  std::uniform_int_distribution<int64_t> size(1, 40);
  for (int trial = 0; trial < 12; ++trial) {
    std::vector<std::vector<int64_t>> per_row(golden_.batch);
    for (auto& sizes : per_row) {
      for (int64_t total = 0; total < golden_.length; total += sizes.back()) {
        sizes.push_back(size(rng));
      }
    }
    ExpectMatchesReference("random chunks #" + std::to_string(trial), per_row);
  }
}

TEST_P(GoldenTest, BatchedAtMixedOffsets) {
  // Both prompts in the same Forward calls, each advancing by a different chunk size per call, so
  // the batch always holds sequences at different offsets.
  CpuEngine engine(model_);
  std::vector<SequenceSlot> slots;
  for (int64_t b = 0; b < golden_.batch; ++b) slots.push_back(*engine.CreateSequence());
  std::vector<int64_t> at(golden_.batch, 0);
  std::vector<std::vector<float>> logits_of(golden_.batch);
  std::vector<float> logits;
  for (int64_t call = 0;; ++call) {
    std::vector<SequenceChunk> batch;
    for (int64_t b = 0; b < golden_.batch; ++b) {
      const int64_t n = std::min<int64_t>((call + 3 * b) % 7 + 1, golden_.length - at[b]);
      if (n > 0) batch.push_back({slots[b], std::span(golden_.input_ids[b]).subspan(at[b], n)});
    }
    if (batch.empty()) break;
    ASSERT_TRUE(engine.Forward(batch, LogitsFor::kEveryToken, &logits).ok());
    int64_t row = 0;
    for (const SequenceChunk& chunk : batch) {
      const int64_t b = std::find(slots.begin(), slots.end(), chunk.slot) - slots.begin();
      const int64_t n = chunk.tokens.size();
      logits_of[b].insert(logits_of[b].end(), logits.begin() + row * golden_.vocab,
                          logits.begin() + (row + n) * golden_.vocab);
      row += n;
      at[b] += n;
    }
  }
  for (int64_t b = 0; b < golden_.batch; ++b) {
    EXPECT_LE(testing::MaxAbsDiff(logits_of[b], std::span(golden_.prefill_logits)
                                                    .subspan(b * golden_.length * golden_.vocab,
                                                             golden_.length * golden_.vocab)),
              kTolerance);
  }
}

TEST_P(GoldenTest, GreedyGeneration) {
  CpuEngine engine(model_);
  float worst = 0;
  for (int64_t b = 0; b < golden_.batch; ++b) {
    const SequenceSlot slot = *engine.CreateSequence();
    std::vector<float> logits;
    SequenceChunk chunk{slot, golden_.input_ids[b]};
    ASSERT_TRUE(engine.Forward({&chunk, 1}, LogitsFor::kLastToken, &logits).ok());
    std::vector<int32_t> generated;
    for (int64_t g = 0; g < golden_.greedy_steps; ++g) {
      worst = std::max(worst, testing::MaxAbsDiff(
                                  logits, golden_.Row(golden_.greedy_logits, b, g,
                                                      golden_.greedy_steps)));
      generated.push_back(
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
      chunk.tokens = std::span(&generated.back(), 1);
      ASSERT_TRUE(engine.Forward({&chunk, 1}, LogitsFor::kLastToken, &logits).ok());
    }
    EXPECT_EQ(generated, golden_.greedy_ids[b]) << "sequence " << b;
  }
  std::printf("[golden] %-16s %-22s max|Δ| vs greedy_logits %.3g\n", GetParam().c_str(), "greedy",
              worst);
  EXPECT_LE(worst, kTolerance);
}

INSTANTIATE_TEST_SUITE_P(AllGoldenModels, GoldenTest,
                         ::testing::ValuesIn(testing::GoldenModelNames()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace ttt
