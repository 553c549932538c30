// The CUDA engine against the golden vectors and against the CPU engine. Skips without a GPU.
#include "server/engine/cuda_engine.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/cuda_ops.h"
#include "server/engine/cpu_engine.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using testing::Golden;

#define SKIP_WITHOUT_GPU() \
  if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine"

// A long decode test's steps: `full`, or at most 40 in the short form tools/sanitize.sh runs
// (TTT_SHORT_TESTS=1), where the tools slow every launch by orders of magnitude. 40 steps still
// commit every sequence's window twice, from any offset.
int DecodeSteps(int full) {
  const char* short_tests = std::getenv("TTT_SHORT_TESTS");
  return short_tests != nullptr && std::string(short_tests) == "1" ? std::min(full, 40) : full;
}

std::unique_ptr<Engine> MakeCudaEngine(std::shared_ptr<const Model> model,
                                       WeightPrecision precision, int64_t max_sequences = 64,
                                       int64_t prefill_tokens_per_step = 0) {
  auto engine = CreateCudaEngine(std::move(model),
                                 {.precision = precision,
                                  .max_sequences = max_sequences,
                                  .prefill_tokens_per_step = prefill_tokens_per_step});
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? std::move(*engine) : nullptr;
}

class CudaGoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    auto model = LoadModel(testing::TestDataPath("golden/" + GetParam()));
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *model;
    golden_ = testing::LoadGolden(GetParam());
  }

  // Every position's logits for each prompt, fed with the given chunk sizes.
  std::vector<std::vector<float>> Run(Engine& engine, const std::vector<int64_t>& sizes) {
    std::vector<std::vector<float>> out;
    for (int64_t b = 0; b < golden_.batch; ++b) {
      const SequenceSlot slot = *engine.CreateSequence();
      out.push_back(testing::FeedInChunks(engine, slot, golden_.input_ids[b], sizes));
      EXPECT_TRUE(engine.ReleaseSequence(slot).ok());
    }
    return out;
  }

  std::shared_ptr<const Model> model_;
  Golden golden_;
};

TEST_P(CudaGoldenTest, Float32MatchesTheReferenceForEveryChunking) {
  auto engine = MakeCudaEngine(model_, WeightPrecision::kFloat32);
  ASSERT_NE(engine, nullptr);
  std::mt19937 rng(5);
  std::vector<std::pair<std::string, std::vector<int64_t>>> chunkings = {
      {"whole prompt", {golden_.length}}, {"token by token", {1}}};
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<int64_t> sizes;
    for (int i = 0; i < 8; ++i) sizes.push_back(std::uniform_int_distribution<int64_t>(1, 40)(rng));
    chunkings.push_back({absl::StrCat("random chunks #", trial), sizes});
  }
  for (const auto& [name, sizes] : chunkings) {
    const auto logits = Run(*engine, sizes);
    float worst_prefill = 0, worst_decode = 0;
    for (int64_t b = 0; b < golden_.batch; ++b) {
      const size_t n = golden_.length * golden_.vocab;
      worst_prefill = std::max(
          worst_prefill,
          testing::MaxAbsDiff(logits[b], std::span(golden_.prefill_logits).subspan(b * n, n)));
      worst_decode = std::max(
          worst_decode,
          testing::MaxAbsDiff(logits[b], std::span(golden_.decode_logits).subspan(b * n, n)));
    }
    std::printf("[cuda-f32] %-16s %-18s max|Δ| vs prefill %.3g, vs decode %.3g\n",
                GetParam().c_str(), name.c_str(), worst_prefill, worst_decode);
    EXPECT_LE(worst_prefill, 1e-3f) << name;
    EXPECT_LE(worst_decode, 1e-3f) << name;
  }
}

TEST_P(CudaGoldenTest, Float32GreedyIdsMatch) {
  auto engine = MakeCudaEngine(model_, WeightPrecision::kFloat32);
  ASSERT_NE(engine, nullptr);
  for (int64_t b = 0; b < golden_.batch; ++b) {
    const SequenceSlot slot = *engine->CreateSequence();
    std::vector<float> logits;
    SequenceChunk chunk{slot, golden_.input_ids[b]};
    ASSERT_TRUE(engine->Forward({&chunk, 1}, LogitsFor::kLastToken, &logits).ok());
    std::vector<int32_t> generated;
    for (int64_t g = 0; g < golden_.greedy_steps; ++g) {
      generated.push_back(
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
      chunk.tokens = std::span(&generated.back(), 1);
      ASSERT_TRUE(engine->Forward({&chunk, 1}, LogitsFor::kLastToken, &logits).ok());
    }
    EXPECT_EQ(generated, golden_.greedy_ids[b]);
  }
}

INSTANTIATE_TEST_SUITE_P(AllGoldenModels, CudaGoldenTest,
                         ::testing::ValuesIn(testing::GoldenModelNames()),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The CPU engine and a GPU engine fed the same random tokens side by side: prompts of the given
// lengths (their logits as `prompt_logits` asks), then `steps` decode steps of a token a sequence,
// all sequences together. `compare(cpu_logits, gpu_logits)` sees the logits of every call that
// returns some.
void RunSideBySide(
    Engine& cpu, Engine& gpu, int32_t vocab_size, const std::vector<int64_t>& prompt_lengths,
    int steps, LogitsFor prompt_logits, uint32_t seed,
    const std::function<void(const std::vector<float>&, const std::vector<float>&)>& compare) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, vocab_size - 1);
  std::vector<std::vector<int32_t>> tokens(prompt_lengths.size());
  std::vector<SequenceChunk> cpu_batch, gpu_batch;
  for (size_t s = 0; s < prompt_lengths.size(); ++s) {
    tokens[s].resize(prompt_lengths[s] + steps);
    for (int32_t& t : tokens[s]) t = token(rng);
    const std::span<const int32_t> prompt = std::span(tokens[s]).first(prompt_lengths[s]);
    cpu_batch.push_back({*cpu.CreateSequence(), prompt});
    gpu_batch.push_back({*gpu.CreateSequence(), prompt});
  }
  std::vector<float> cpu_logits, gpu_logits;
  ASSERT_TRUE(cpu.Forward(cpu_batch, prompt_logits, &cpu_logits).ok());
  ASSERT_TRUE(gpu.Forward(gpu_batch, prompt_logits, &gpu_logits).ok());
  if (prompt_logits != LogitsFor::kNone) compare(cpu_logits, gpu_logits);
  for (int step = 0; step < steps; ++step) {
    for (size_t s = 0; s < tokens.size(); ++s) {
      cpu_batch[s].tokens = gpu_batch[s].tokens =
          std::span(tokens[s]).subspan(prompt_lengths[s] + step, 1);
    }
    ASSERT_TRUE(cpu.Forward(cpu_batch, LogitsFor::kLastToken, &cpu_logits).ok());
    ASSERT_TRUE(gpu.Forward(gpu_batch, LogitsFor::kLastToken, &gpu_logits).ok());
    compare(cpu_logits, gpu_logits);
  }
}

// A `compare` for RunSideBySide that keeps the largest |Δ| between the engines' logits in *worst.
auto KeepLargestGap(float* worst) {
  return [worst](const std::vector<float>& cpu_logits, const std::vector<float>& gpu_logits) {
    *worst = std::max(*worst, testing::MaxAbsDiff(cpu_logits, gpu_logits));
  };
}

// The bf16 bounds' measures over rows of logits: ‖out − ref‖ / ‖ref‖, and how many rows agree on
// their argmax.
struct Bf16Agreement {
  double diff = 0, norm = 0;
  int64_t agree = 0, positions = 0;

  void Add(std::span<const float> out, std::span<const float> ref) {
    for (size_t i = 0; i < ref.size(); ++i) {
      diff += (out[i] - ref[i]) * (out[i] - ref[i]);
      norm += ref[i] * ref[i];
    }
    agree += std::max_element(out.begin(), out.end()) - out.begin() ==
             std::max_element(ref.begin(), ref.end()) - ref.begin();
    ++positions;
  }
  double relative() const { return std::sqrt(diff / norm); }
};

// bf16 weights: relative error per model, and argmax agreement pooled over every golden position
// (one model's 74 positions make a single near-tie worth 1.4%).
TEST(CudaBFloat16Test, CloseToTheReferenceAndAgreesOnArgmax) {
  SKIP_WITHOUT_GPU();
  int64_t agree = 0, positions = 0;
  for (const std::string& name : testing::GoldenModelNames()) {
    auto model = LoadModel(testing::TestDataPath("golden/" + name));
    ASSERT_TRUE(model.ok()) << model.status();
    const Golden golden = testing::LoadGolden(name);
    auto engine = MakeCudaEngine(*model, WeightPrecision::kBFloat16);
    ASSERT_NE(engine, nullptr);
    for (const int64_t chunk : {golden.length, int64_t{1}}) {
      Bf16Agreement model_agreement;
      for (int64_t b = 0; b < golden.batch; ++b) {
        const SequenceSlot slot = *engine->CreateSequence();
        const std::vector<float> logits =
            testing::FeedInChunks(*engine, slot, golden.input_ids[b], {chunk});
        ASSERT_TRUE(engine->ReleaseSequence(slot).ok());
        for (int64_t t = 0; t < golden.length; ++t) {
          model_agreement.Add(std::span(logits).subspan(t * golden.vocab, golden.vocab),
                              golden.Row(golden.prefill_logits, b, t, golden.length));
        }
      }
      std::printf(
          "[cuda-bf16] %-16s chunk %-3lld relative error %.3g, argmax agreement %lld/%lld\n",
          name.c_str(), static_cast<long long>(chunk), model_agreement.relative(),
          static_cast<long long>(model_agreement.agree),
          static_cast<long long>(model_agreement.positions));
      EXPECT_LE(model_agreement.relative(), 2e-2) << name;
      agree += model_agreement.agree;
      positions += model_agreement.positions;
    }
  }
  std::printf("[cuda-bf16] argmax agreement over all golden positions: %.2f%%\n",
              100.0 * agree / positions);
  EXPECT_GE(double(agree) / positions, 0.98);
}

// The random model of the bf16 tests below: wide enough a feed-forward for many output tiles.
ModelConfig Bf16TestConfig() {
  ModelConfig c;
  c.vocab_size = 211;
  c.hidden_size = 128;
  c.num_attention_heads = 2;
  c.intermediate_size = 1536;
  c.num_hidden_layers = 2;
  c.conv_kernel = 4;
  c.share_qk = c.use_gate = c.pre_conv = true;
  c.tie_word_embeddings = false;
  return c;
}

// A RunSideBySide `compare` that adds every row of logits to `agreement`.
auto AddRows(int32_t vocab_size, Bf16Agreement* agreement) {
  return [vocab_size, agreement](const std::vector<float>& cpu_logits,
                                 const std::vector<float>& gpu_logits) {
    for (size_t row = 0; row < cpu_logits.size() / vocab_size; ++row) {
      agreement->Add(std::span(gpu_logits).subspan(row * vocab_size, vocab_size),
                     std::span(cpu_logits).subspan(row * vocab_size, vocab_size));
    }
  };
}

// Prints `agreement` under `label` and holds it to the golden models' bf16 bounds.
void ExpectWithinBf16Bounds(const Bf16Agreement& agreement, const char* label) {
  std::printf("[cuda-bf16] %s: relative error %.3g, argmax agreement %lld/%lld\n", label,
              agreement.relative(), static_cast<long long>(agreement.agree),
              static_cast<long long>(agreement.positions));
  EXPECT_LE(agreement.relative(), 2e-2) << label;
  EXPECT_GE(double(agreement.agree) / agreement.positions, 0.98) << label;
}

// bf16 weights at batches of 256 and 64 (the golden models' test decodes a sequence at a time,
// its products on SkinnyGemm; here they run on cuBLAS, and on Hopper on our tensor-core kernels,
// whose tiles differ at the two batches), and at every head size the batched decode kernel has
// (W1 in halves: its shared copy's rows are f floats), against the CPU engine in float32: a random
// model, sequences at mixed offsets decoding 20 steps, held to the golden models' bounds.
// The batched decode kernel comes in two register budgets (ttt_scan.cu, PlanDecodeGrid): 256
// sequences of 12 heads, 125m's shape, are 3,072 items, which on an H200 take the 13-warp form
// (too few warps lighter than the busiest for the commits); the other batches take 12.
struct Bf16Batch {
  int sequences;
  int head_dim;
  int heads = 0;  // 0: as many as Bf16TestConfig's width holds.
};

class CudaBFloat16BatchTest : public ::testing::TestWithParam<Bf16Batch> {};

TEST_P(CudaBFloat16BatchTest, CloseToTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  const auto [sequences, head_dim, heads] = GetParam();
  ModelConfig c = Bf16TestConfig();
  c.num_attention_heads = heads > 0 ? heads : c.hidden_size / head_dim;
  c.hidden_size = c.num_attention_heads * head_dim;
  auto model = testing::RandomModel(c, 11);
  CpuEngine cpu(model);
  auto gpu = MakeCudaEngine(model, WeightPrecision::kBFloat16, sequences);
  ASSERT_NE(gpu, nullptr);
  std::vector<int64_t> prompt_lengths(sequences);
  for (int s = 0; s < sequences; ++s) prompt_lengths[s] = 1 + s % 23;
  Bf16Agreement agreement;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(cpu, *gpu, c.vocab_size, prompt_lengths, /*steps=*/20,
                                        LogitsFor::kNone, /*seed=*/5,
                                        AddRows(c.vocab_size, &agreement)));
  ExpectWithinBf16Bounds(agreement, absl::StrCat("batch ", sequences, ", head size ", head_dim,
                                                 ", heads ", c.num_attention_heads)
                                        .c_str());
}

INSTANTIATE_TEST_SUITE_P(BatchesAndHeadSizes, CudaBFloat16BatchTest,
                         ::testing::Values(Bf16Batch{256, 64}, Bf16Batch{256, 64, 12},
                                           Bf16Batch{64, 64}, Bf16Batch{64, 32}, Bf16Batch{64, 16}),
                         [](const ::testing::TestParamInfo<Bf16Batch>& info) {
                           return absl::StrCat(
                               "Of", info.param.sequences, "HeadSize", info.param.head_dim,
                               info.param.heads > 0 ? absl::StrCat("Heads", info.param.heads) : "");
                         });

// A prompt step of 200 rows (8 sequences of 25 tokens), which on Hopper takes our tensor-core
// products (bf16 steps of 64-256 rows) with rows that end inside their 64-row tiles:
// every prompt position's logits against the CPU engine, then 10 decode steps, held to the golden
// models' bounds.
TEST(CudaBFloat16Test, PromptStepOf200RowsCloseToTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = Bf16TestConfig();
  auto model = testing::RandomModel(c, 13);
  CpuEngine cpu(model);
  auto gpu = MakeCudaEngine(model, WeightPrecision::kBFloat16, 8);
  ASSERT_NE(gpu, nullptr);
  Bf16Agreement agreement;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(cpu, *gpu, c.vocab_size, std::vector<int64_t>(8, 25),
                                        /*steps=*/10, LogitsFor::kEveryToken, /*seed=*/9,
                                        AddRows(c.vocab_size, &agreement)));
  EXPECT_EQ(agreement.positions, 200 + 10 * 8);
  ExpectWithinBf16Bounds(agreement, "prompt step of 200 rows");
}

// With bf16 weights the engine reads θ0 as bf16 from the upper halves of W1, which it holds in
// halves (the state stays float32 to the bit). That must not drift: six sequences at mixed
// offsets decode 400 steps (25 windows committed each) against the CPU engine in float32, held to
// the golden models' bounds over the last 100 steps as over all of them.
TEST(CudaBFloat16Test, FourHundredDecodeStepsStayCloseToTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = Bf16TestConfig();
  auto model = testing::RandomModel(c, 17);
  CpuEngine cpu(model);
  auto gpu = MakeCudaEngine(model, WeightPrecision::kBFloat16, 6);
  ASSERT_NE(gpu, nullptr);
  constexpr int kSteps = 400, kLastSteps = 100;
  Bf16Agreement all_steps, last_steps;
  int step = 0;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(
      cpu, *gpu, c.vocab_size, {1, 5, 9, 16, 22, 31}, kSteps, LogitsFor::kNone, /*seed=*/21,
      [&](const std::vector<float>& cpu_logits, const std::vector<float>& gpu_logits) {
        AddRows(c.vocab_size, &all_steps)(cpu_logits, gpu_logits);
        if (step++ >= kSteps - kLastSteps) {
          AddRows(c.vocab_size, &last_steps)(cpu_logits, gpu_logits);
        }
      }));
  ExpectWithinBf16Bounds(all_steps, "400 decode steps");
  ExpectWithinBf16Bounds(last_steps, "their last 100");
}

// Saved states hold W1 whole, as every backend reads them, while a bf16 engine holds it in
// halves: a forked or restored sequence continues exactly, restoring and saving again gives the
// same bytes, and the CPU engine continues the GPU's state within the bf16 relative error (a W1
// joined wrongly would be far off; over 31 positions one near-tie is 3% of argmax agreement, so
// that bound is left to the pooled tests above).
TEST(CudaBFloat16Test, SavedStatesHoldW1WholeAndContinue) {
  SKIP_WITHOUT_GPU();
  auto model = LoadModel(testing::TestDataPath("golden/tiny-linear-m"));
  ASSERT_TRUE(model.ok()) << model.status();
  const int32_t vocab = (*model)->config.vocab_size;
  std::vector<int32_t> tokens;
  for (int32_t i = 0; i < 50; ++i) tokens.push_back((i * 41 + 3) % vocab);
  const std::span<const int32_t> all(tokens);
  auto feed = [](Engine& engine, SequenceSlot slot, std::span<const int32_t> chunk_tokens) {
    std::vector<float> logits;
    const SequenceChunk chunk{slot, chunk_tokens};
    EXPECT_TRUE(engine.Forward({&chunk, 1}, LogitsFor::kEveryToken, &logits).ok());
    return logits;
  };
  auto gpu = MakeCudaEngine(*model, WeightPrecision::kBFloat16);
  ASSERT_NE(gpu, nullptr);
  const SequenceSlot original = *gpu->CreateSequence();
  feed(*gpu, original, all.first(19));  // One window committed, three tokens pending.
  const SequenceSlot fork = *gpu->ForkSequence(original);
  const std::string saved = *gpu->SaveSequence(original);
  const SequenceSlot restored = *gpu->RestoreSequence(saved);
  EXPECT_EQ(*gpu->SaveSequence(restored), saved);
  const std::vector<float> expected = feed(*gpu, original, all.subspan(19));
  EXPECT_EQ(feed(*gpu, fork, all.subspan(19)), expected);
  EXPECT_EQ(feed(*gpu, restored, all.subspan(19)), expected);

  CpuEngine cpu(*model);
  auto on_cpu = cpu.RestoreSequence(saved);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  Bf16Agreement agreement;
  AddRows(vocab, &agreement)(feed(cpu, *on_cpu, all.subspan(19)), expected);
  std::printf(
      "[cuda-bf16] the CPU engine continuing a bf16 GPU state: relative error %.3g, "
      "argmax agreement %lld/%lld\n",
      agreement.relative(), static_cast<long long>(agreement.agree),
      static_cast<long long>(agreement.positions));
  EXPECT_LE(agreement.relative(), 2e-2);
}

// GPU (float32) and CPU engines on random models of every inner type, backbone flag and head size
// the decode kernel has a form for (f = 64 and 32; the golden models have 16).
class CudaMatchesCpuTest : public ::testing::TestWithParam<std::tuple<TttLayerType, int, int>> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    model_ = ParamModel();
    cpu_ = std::make_unique<CpuEngine>(model_);
    gpu_ = MakeCudaEngine(model_, WeightPrecision::kFloat32);
    ASSERT_NE(gpu_, nullptr);
  }
  // The parameters' model, seeded by its flags.
  std::shared_ptr<const Model> ParamModel() const {
    const auto [inner, flags, head_dim] = GetParam();
    ModelConfig c;
    c.vocab_size = 211;
    c.hidden_size = 128;
    c.num_attention_heads = c.hidden_size / head_dim;
    // f = 32 takes the other forms of two kernels: SwiGLU's one-column form (I = 90, against 96)
    // and the decode kernel's any-conv form (three taps, against four).
    c.intermediate_size = head_dim == 64 ? 96 : 90;
    c.conv_kernel = head_dim == 64 ? 4 : 3;
    c.num_hidden_layers = 2;
    c.ttt_layer_type = inner;
    c.ttt_base_lr = inner == TttLayerType::kMlp ? 0.1 : 1.0;
    c.share_qk = flags & 1;
    c.use_gate = flags & 2;
    c.pre_conv = flags & 4;
    c.tie_word_embeddings = flags % 2 == 0;
    return testing::RandomModel(c, 100 + flags);
  }
  std::shared_ptr<const Model> model_;
  std::unique_ptr<CpuEngine> cpu_;
  std::unique_ptr<Engine> gpu_;
};

// Five sequences at different offsets stepping together for 300 decode steps (DecodeSteps).
TEST_P(CudaMatchesCpuTest, MixedOffsetBatchOverManySteps) {
  const auto [inner, flags, head_dim] = GetParam();
  // Five sequences: the decode step runs in the graph of bucket 8, three rows idle.
  const int steps = DecodeSteps(300);
  float worst = 0;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(*cpu_, *gpu_, model_->config.vocab_size, {1, 9, 16, 45, 3},
                                        steps, LogitsFor::kEveryToken, flags,
                                        KeepLargestGap(&worst)));
  std::printf("[cuda-vs-cpu] %s flags %d f %d: max|Δ| %.3g over %d steps\n",
              inner == TttLayerType::kMlp ? "mlp" : "linear", flags, head_dim, worst, steps);
  EXPECT_LE(worst, 1e-3f);
}

// Steps that mix prompts with single tokens, as a server's do while requests arrive: the single
// tokens take the decode kernel and the prompts the scan, in one step. Six sequences; each step
// but every fourth, one of them takes a chunk of 2–19 tokens (some close a window, some cross
// one), and every fifth step another takes none, so some steps are single tokens beside an empty
// chunk (the scan then has no segment); 60 steps (DecodeSteps), every row's logits compared.
TEST_P(CudaMatchesCpuTest, StepsMixingPromptsWithSingleTokens) {
  const auto [inner, flags, head_dim] = GetParam();
  Engine &cpu = *cpu_, &gpu = *gpu_;
  constexpr int kSequences = 6;
  std::mt19937 rng(flags);
  std::uniform_int_distribution<int32_t> token(0, model_->config.vocab_size - 1);
  std::vector<SequenceChunk> cpu_batch(kSequences), gpu_batch(kSequences);
  std::vector<std::vector<int32_t>> tokens(kSequences);
  for (int s = 0; s < kSequences; ++s) {
    cpu_batch[s].slot = *cpu.CreateSequence();
    gpu_batch[s].slot = *gpu.CreateSequence();
  }
  const int steps = DecodeSteps(60);
  float worst = 0;
  std::vector<float> cpu_logits, gpu_logits;
  for (int step = 0; step < steps; ++step) {
    for (int s = 0; s < kSequences; ++s) {
      const bool prompt = s == step % kSequences && step % 4 != 3;
      const bool none = step % 5 == 0 && s == (step + 3) % kSequences;
      tokens[s].resize(prompt ? 2 + step * 7 % 18 : (none ? 0 : 1));
      for (int32_t& t : tokens[s]) t = token(rng);
      cpu_batch[s].tokens = gpu_batch[s].tokens = tokens[s];
    }
    ASSERT_TRUE(cpu.Forward(cpu_batch, LogitsFor::kEveryToken, &cpu_logits).ok());
    ASSERT_TRUE(gpu.Forward(gpu_batch, LogitsFor::kEveryToken, &gpu_logits).ok());
    ASSERT_EQ(gpu_logits.size(), cpu_logits.size());
    worst = std::max(worst, testing::MaxAbsDiff(cpu_logits, gpu_logits));
  }
  std::printf("[cuda-vs-cpu, mixed steps] %s flags %d f %d: max|Δ| %.3g over %d steps\n",
              inner == TttLayerType::kMlp ? "mlp" : "linear", flags, head_dim, worst, steps);
  EXPECT_LE(worst, 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(EveryInnerAndFlag, CudaMatchesCpuTest,
                         ::testing::Combine(::testing::Values(TttLayerType::kLinear,
                                                              TttLayerType::kMlp),
                                            ::testing::Range(0, 8), ::testing::Values(64, 32)));

// Decode at batch 1 runs every layer in one kernel (cu::SequenceStep). Engines that must use it
// against the CPU engine: one sequence decoding 70 tokens (DecodeSteps) after a prompt of 9
// (windows committed four times, the last mid-window), on a random TTT-Linear model.
struct SequenceStepRun {
  float worst = 0;  // max|Δ| of the logits
  Bf16Agreement agreement;
};

SequenceStepRun RunSequenceStep(const ModelConfig& c, WeightPrecision precision, uint32_t seed) {
  SequenceStepRun run;
  auto model = testing::RandomModel(c, seed);
  CpuEngine cpu(model);
  auto gpu = CreateCudaEngine(
      model, {.precision = precision,
              .max_sequences = 4,
              .single_sequence_kernel = CudaEngineOptions::SingleSequenceKernel::kRequired});
  EXPECT_TRUE(gpu.ok()) << gpu.status();
  if (!gpu.ok()) return run;
  RunSideBySide(cpu, **gpu, c.vocab_size, {9}, DecodeSteps(70), LogitsFor::kNone, seed,
                [&](const std::vector<float>& cpu_logits, const std::vector<float>& gpu_logits) {
                  run.worst = std::max(run.worst, testing::MaxAbsDiff(cpu_logits, gpu_logits));
                  run.agreement.Add(gpu_logits, cpu_logits);
                });
  return run;
}

// Every backbone flag and head size the TTT step has a form for.
ModelConfig SequenceStepModel(int flags, int head_dim) {
  ModelConfig c;
  c.vocab_size = 211;
  c.hidden_size = 128;
  c.num_attention_heads = c.hidden_size / head_dim;
  c.intermediate_size = 96;
  c.conv_kernel = head_dim == 32 ? 3 : 4;
  c.num_hidden_layers = 3;
  c.share_qk = flags & 1;
  c.use_gate = flags & 2;
  c.pre_conv = flags & 4;
  c.tie_word_embeddings = flags % 2 == 0;
  return c;
}

// float32: held to the golden bound.
class CudaSequenceStepTest : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(CudaSequenceStepTest, OneSequenceMatchesTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  const auto [flags, head_dim] = GetParam();
  const SequenceStepRun run =
      RunSequenceStep(SequenceStepModel(flags, head_dim), WeightPrecision::kFloat32, 300 + flags);
  std::printf("[sequence-step] f32 flags %d f %d: max|Δ| %.3g\n", flags, head_dim, run.worst);
  EXPECT_LE(run.worst, 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(EveryFlagAndHeadSize, CudaSequenceStepTest,
                         ::testing::Combine(::testing::Range(0, 8), ::testing::Values(64, 32, 16)));

// bf16: each model's relative error, and argmax agreement pooled over all of them (a model's 70
// positions make one near-tie worth 1.4%), as the golden models' bf16 test holds them.
TEST(CudaSequenceStepTest, BFloat16CloseToTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  Bf16Agreement pooled;
  for (int flags = 0; flags < 8; ++flags) {
    for (const int head_dim : {64, 32, 16}) {
      const SequenceStepRun run = RunSequenceStep(SequenceStepModel(flags, head_dim),
                                                  WeightPrecision::kBFloat16, 300 + flags);
      std::printf("[sequence-step] bf16 flags %d f %d: relative error %.3g, argmax %lld/%lld\n",
                  flags, head_dim, run.agreement.relative(),
                  static_cast<long long>(run.agreement.agree),
                  static_cast<long long>(run.agreement.positions));
      EXPECT_LE(run.agreement.relative(), 2e-2) << "flags " << flags << " f " << head_dim;
      pooled.agree += run.agreement.agree;
      pooled.positions += run.agreement.positions;
    }
  }
  std::printf("[sequence-step] bf16 argmax agreement: %lld/%lld\n",
              static_cast<long long>(pooled.agree), static_cast<long long>(pooled.positions));
  EXPECT_GE(double(pooled.agree) / pooled.positions, 0.98);
}

// Two layers 1,024 wide, with every backbone flag.
ModelConfig WideSequenceStepModel(int intermediate_size) {
  ModelConfig c = SequenceStepModel(/*flags=*/7, /*head_dim=*/64);
  c.hidden_size = 1024;
  c.num_attention_heads = 16;
  c.intermediate_size = intermediate_size;
  c.num_hidden_layers = 2;
  return c;
}

// A model wide enough that the kernel's ring of shared-memory slots is refilled within a product
// (gate_up: 64 rows of 4 KB a block, eight a slot: eight chunks through five slots).
TEST(CudaSequenceStepTest, AWideModelMatchesTheCpuEngine) {
  SKIP_WITHOUT_GPU();
  const SequenceStepRun run =
      RunSequenceStep(WideSequenceStepModel(4096), WeightPrecision::kFloat32, 17);
  std::printf("[sequence-step] f32 wide: max|Δ| %.3g\n", run.worst);
  EXPECT_LE(run.worst, 1e-3f);
}

// bf16 on a wide model, where down_proj's rows come three a slot (a row a warp's unit), against
// the per-stage kernels with the same bf16 weights. Those round the products' inputs to bf16
// where the kernel keeps them in float32, so the two differ by that rounding, well inside the
// bf16 bound (a row misplaced or a chunk read twice would not be).
TEST(CudaSequenceStepTest, ABFloat16WideModelMatchesThePerStageKernels) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = WideSequenceStepModel(5000);
  auto model = testing::RandomModel(c, 23);
  auto per_stage = CreateCudaEngine(
      model, {.precision = WeightPrecision::kBFloat16,
              .max_sequences = 4,
              .single_sequence_kernel = CudaEngineOptions::SingleSequenceKernel::kOff});
  auto one_kernel = CreateCudaEngine(
      model, {.precision = WeightPrecision::kBFloat16,
              .max_sequences = 4,
              .single_sequence_kernel = CudaEngineOptions::SingleSequenceKernel::kRequired});
  ASSERT_TRUE(per_stage.ok()) << per_stage.status();
  ASSERT_TRUE(one_kernel.ok()) << one_kernel.status();
  Bf16Agreement agreement;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(
      **per_stage, **one_kernel, c.vocab_size, {9}, DecodeSteps(70), LogitsFor::kNone, 23,
      [&](const std::vector<float>& per_stage_logits, const std::vector<float>& kernel_logits) {
        agreement.Add(kernel_logits, per_stage_logits);
      }));
  std::printf("[sequence-step] bf16 wide against the per-stage kernels: relative error %.3g, "
              "argmax %lld/%lld\n",
              agreement.relative(), static_cast<long long>(agreement.agree),
              static_cast<long long>(agreement.positions));
  EXPECT_LE(agreement.relative(), 1e-2);
  EXPECT_GE(agreement.agree, agreement.positions - 1);  // One near-tie at most.
}

// By default the engine times a lone sequence's decode step through the one kernel and through
// the kernels per stage as it starts, and keeps the faster, which then decodes as the CPU engine
// does. Asked for either path, it takes that one.
TEST(CudaSequenceStepTest, ByDefaultALoneSequenceDecodesThroughThePathTimedFaster) {
  SKIP_WITHOUT_GPU();
  const ModelConfig c = SequenceStepModel(/*flags=*/7, /*head_dim=*/64);
  auto model = testing::RandomModel(c, 41);
  auto chosen =
      CreateCudaEngine(model, {.precision = WeightPrecision::kFloat32, .max_sequences = 4});
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  const std::string path = (*chosen)->single_sequence_decode();
  std::printf("[sequence-step] by default: %s\n", path.c_str());
  const std::string timed = "(timed at start: one kernel ";
  const size_t at = path.find(timed);
  ASSERT_NE(at, std::string::npos) << path;
  double one_kernel_ms = 0, per_stage_ms = 0;
  ASSERT_EQ(std::sscanf(path.c_str() + at + timed.size(), "%lf ms a step, kernels per stage %lf",
                        &one_kernel_ms, &per_stage_ms),
            2)
      << path;
  EXPECT_GT(one_kernel_ms, 0);
  EXPECT_GT(per_stage_ms, 0);
  EXPECT_TRUE(
      path.starts_with(one_kernel_ms < per_stage_ms ? "one kernel (" : "kernels per stage ("))
      << path;

  CpuEngine cpu(model);
  float worst = 0;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(cpu, **chosen, c.vocab_size, {9}, /*steps=*/40,
                                        LogitsFor::kNone, 41, KeepLargestGap(&worst)));
  EXPECT_LE(worst, 1e-3f);

  using Choice = CudaEngineOptions::SingleSequenceKernel;
  for (const auto& [choice, expected] : {std::pair{Choice::kOff, "kernels per stage"},
                                         std::pair{Choice::kWhereItFits, "one kernel"}}) {
    auto engine = CreateCudaEngine(model, {.max_sequences = 4, .single_sequence_kernel = choice});
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->single_sequence_decode(), expected);
  }
}

// The GPU sampler's sums are exact for rows of up to kMaxSamplerVocabulary logits; a wider model is
// refused when the engine is made, not at its first sampled token. (No GPU needed: the model is
// checked first.)
TEST(CudaEngineTest, RefusesAVocabularyWiderThanTheSamplerTakes) {
  ModelConfig c;
  c.vocab_size = kernels::cuda::kMaxSamplerVocabulary + 1;
  c.hidden_size = 8;
  c.num_attention_heads = 2;
  c.intermediate_size = 8;
  c.num_hidden_layers = 1;
  auto engine = CreateCudaEngine(testing::RandomModel(c, 5), {.max_sequences = 1});
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("vocab_size: 524288"), std::string::npos)
      << engine.status();
}

// A model the single-sequence kernel does not cover (TTT-MLP) decodes at batch 1 through the
// per-stage kernels, or, when the kernel is required, is refused at creation with a clear error.
TEST(CudaSequenceStepTest, AModelItDoesNotCoverFallsBackOrIsRefused) {
  SKIP_WITHOUT_GPU();
  ModelConfig c;
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.intermediate_size = 64;
  c.num_hidden_layers = 1;
  c.ttt_layer_type = TttLayerType::kMlp;
  auto model = testing::RandomModel(c, 3);
  auto required = CreateCudaEngine(
      model, {.max_sequences = 4,
              .single_sequence_kernel = CudaEngineOptions::SingleSequenceKernel::kRequired});
  ASSERT_FALSE(required.ok());
  EXPECT_EQ(required.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(required.status().message().find("single_sequence_kernel"), std::string::npos);

  auto fallback = CreateCudaEngine(
      model, {.max_sequences = 4,
              .single_sequence_kernel = CudaEngineOptions::SingleSequenceKernel::kWhereItFits});
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ((*fallback)->single_sequence_decode(),
            "kernels per stage (the one kernel does not cover this model)");
  CpuEngine cpu(model);
  Bf16Agreement agreement;
  ASSERT_NO_FATAL_FAILURE(RunSideBySide(
      cpu, **fallback, c.vocab_size, {5}, /*steps=*/20, LogitsFor::kNone, 1,
      [&](const std::vector<float>& cpu_logits, const std::vector<float>& gpu_logits) {
        agreement.Add(gpu_logits, cpu_logits);
      }));
  EXPECT_LE(agreement.relative(), 2e-2);
}

// The single-sequence kernel runs each head in a block of its own beside blocks that run none, so
// it needs fewer heads than the GPU has SMs. With one head fewer a model decodes through it; with
// as many it falls back to the kernels per stage, or is refused where the kernel is required.
// Either way it decodes as the CPU engine does.
TEST(CudaSequenceStepTest, AsManyHeadsAsSmsFallBackToTheKernelsPerStage) {
  SKIP_WITHOUT_GPU();
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  using Choice = CudaEngineOptions::SingleSequenceKernel;
  for (const int heads : {sms - 1, sms}) {
    ModelConfig c;
    c.vocab_size = 97;
    c.hidden_size = 16 * heads;
    c.num_attention_heads = heads;
    c.intermediate_size = 64;
    c.num_hidden_layers = 1;
    c.share_qk = true;
    c.pre_conv = true;
    auto model = testing::RandomModel(c, 5);
    const bool fits = heads < sms;
    auto required = CreateCudaEngine(model, {.precision = WeightPrecision::kFloat32,
                                             .max_sequences = 4,
                                             .single_sequence_kernel = Choice::kRequired});
    EXPECT_EQ(required.ok(), fits) << heads << " heads: " << required.status();
    if (!fits) {
      EXPECT_EQ(required.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_NE(required.status().message().find("single_sequence_kernel"), std::string::npos);
    }
    auto engine = CreateCudaEngine(model, {.precision = WeightPrecision::kFloat32,
                                           .max_sequences = 4,
                                           .single_sequence_kernel = Choice::kWhereItFits});
    ASSERT_TRUE(engine.ok()) << engine.status();
    EXPECT_EQ((*engine)->single_sequence_decode(),
              fits ? "one kernel" : "kernels per stage (the one kernel does not cover this model)");
    CpuEngine cpu(model);
    float worst = 0;
    ASSERT_NO_FATAL_FAILURE(RunSideBySide(cpu, **engine, c.vocab_size, {9}, /*steps=*/20,
                                          LogitsFor::kNone, 5, KeepLargestGap(&worst)));
    std::printf("[sequence-step] %d heads on %d SMs: %s, max|Δ| %.3g\n", heads, sms,
                (*engine)->single_sequence_decode().c_str(), worst);
    EXPECT_LE(worst, 1e-3f);
  }
}

// A decode step of more (sequence, head) pairs than the device holds warps at once, so that each
// of the decode kernel's warps walks several, copying the next one's θ0 while computing one: 1,024
// sequences at mixed offsets, each decoded token by token, against the same tokens run as one
// prefill (a different kernel) per sequence. For each head size f the decode kernel has.
class CudaDecodeTest : public ::testing::TestWithParam<int> {};

TEST_P(CudaDecodeTest, ManySequencesDecodedTokenByTokenMatchPrefill) {
  SKIP_WITHOUT_GPU();
  const int head_dim = GetParam();
  ModelConfig c;
  c.vocab_size = 97;
  c.hidden_size = 256;
  c.num_attention_heads = c.hidden_size / head_dim;  // 4,096 to 16,384 items a step.
  c.intermediate_size = 64;
  c.num_hidden_layers = 1;
  c.share_qk = true;
  c.pre_conv = true;
  auto model = testing::RandomModel(c, 7);
  constexpr int kSequences = 1024, kDecodeSteps = 20;
  auto prefilled = MakeCudaEngine(model, WeightPrecision::kFloat32, kSequences);
  auto decoded = MakeCudaEngine(model, WeightPrecision::kFloat32, kSequences);
  ASSERT_NE(prefilled, nullptr);
  ASSERT_NE(decoded, nullptr);

  std::mt19937 rng(3);
  std::uniform_int_distribution<int32_t> token(0, c.vocab_size - 1);
  std::uniform_int_distribution<int> prompt_length(1, 40);
  std::vector<std::vector<int32_t>> tokens(kSequences);
  std::vector<int> prompt(kSequences);
  std::vector<SequenceChunk> whole, steps;
  for (int s = 0; s < kSequences; ++s) {
    prompt[s] = prompt_length(rng);
    tokens[s].resize(prompt[s] + kDecodeSteps);
    for (int32_t& t : tokens[s]) t = token(rng);
    whole.push_back({*prefilled->CreateSequence(), tokens[s]});
    steps.push_back({*decoded->CreateSequence(), std::span(tokens[s]).first(prompt[s])});
  }
  std::vector<float> all_logits, step_logits;
  ASSERT_TRUE(prefilled->Forward(whole, LogitsFor::kEveryToken, &all_logits).ok());
  ASSERT_TRUE(decoded->Forward(steps, LogitsFor::kLastToken, &step_logits).ok());
  std::vector<int64_t> first_row(kSequences);  // Of each sequence's rows in all_logits.
  for (int s = 1; s < kSequences; ++s) first_row[s] = first_row[s - 1] + tokens[s - 1].size();
  const int64_t V = c.vocab_size;
  float worst = 0;
  for (int step = 0; step < kDecodeSteps; ++step) {
    for (int s = 0; s < kSequences; ++s) {
      steps[s].tokens = std::span(tokens[s]).subspan(prompt[s] + step, 1);
    }
    ASSERT_TRUE(decoded->Forward(steps, LogitsFor::kLastToken, &step_logits).ok());
    for (int s = 0; s < kSequences; ++s) {
      const float* expected = &all_logits[(first_row[s] + prompt[s] + step) * V];
      for (int64_t v = 0; v < V; ++v) {
        worst = std::max(worst, std::abs(step_logits[s * V + v] - expected[v]));
      }
    }
  }
  std::printf("[cuda-decode] f %d, %d sequences, %d steps: max|decode - prefill| %.3g\n",
              head_dim, kSequences, kDecodeSteps, worst);
  EXPECT_LE(worst, 1e-3f);
}

INSTANTIATE_TEST_SUITE_P(EveryHeadSize, CudaDecodeTest, ::testing::Values(64, 32, 16));

// Tokens chosen on the GPU: greedy ids equal the reference's; seeded draws equal the CPU
// sampler's whenever float32 rounding leaves the kept sets alike (nearly always).
TEST(CudaSamplingTest, GreedyOnTheGpuReproducesTheReference) {
  SKIP_WITHOUT_GPU();
  for (const std::string& name : testing::GoldenModelNames()) {
    auto model = LoadModel(testing::TestDataPath("golden/" + name));
    ASSERT_TRUE(model.ok());
    const Golden golden = testing::LoadGolden(name);
    auto engine = MakeCudaEngine(*model, WeightPrecision::kFloat32);
    ASSERT_NE(engine, nullptr);
    std::vector<SequenceChunk> batch;
    for (int64_t b = 0; b < golden.batch; ++b) {
      batch.push_back({*engine->CreateSequence(), golden.input_ids[b]});
    }
    const std::vector<SamplingParams> greedy(golden.batch);
    std::vector<SampledToken> sampled;
    std::vector<std::vector<int32_t>> generated(golden.batch);
    for (int64_t g = 0; g < golden.greedy_steps; ++g) {
      ASSERT_TRUE(engine->ForwardAndSample(batch, greedy, &sampled).ok());
      for (int64_t b = 0; b < golden.batch; ++b) {
        generated[b].push_back(sampled[b].id);
        batch[b].tokens = std::span(&generated[b].back(), 1);
      }
    }
    EXPECT_EQ(generated, golden.greedy_ids) << name;
  }
}

TEST(CudaSamplingTest, SeededDrawsMatchTheCpuSampler) {
  SKIP_WITHOUT_GPU();
  auto model = LoadModel(testing::TestDataPath("golden/small-linear-m64"));
  ASSERT_TRUE(model.ok());
  auto gpu = MakeCudaEngine(*model, WeightPrecision::kFloat32);
  ASSERT_NE(gpu, nullptr);
  CpuEngine cpu(*model);
  const std::vector<SamplingParams> settings = {
      {.temperature = 1.0f, .seed = 1},
      {.temperature = 0.7f, .top_k = 20, .seed = 2},
      {.temperature = 1.3f, .top_p = 0.8f, .seed = 3},
      {.temperature = 1.0f, .min_p = 0.05f, .seed = 4},
      {.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .min_p = 0.01f, .seed = 5}};
  int same = 0, draws = 0;
  double worst_logprob = 0;
  for (const SamplingParams& params : settings) {
    const std::vector<int32_t> prompt = {1, 40, 41, 42};
    SequenceChunk on_gpu{*gpu->CreateSequence(), prompt}, on_cpu{*cpu.CreateSequence(), prompt};
    std::vector<SampledToken> from_gpu, from_cpu;
    std::vector<int32_t> gpu_tokens, cpu_tokens;
    for (int step = 0; step < 60; ++step) {
      ASSERT_TRUE(gpu->ForwardAndSample({&on_gpu, 1}, {&params, 1}, &from_gpu).ok());
      ASSERT_TRUE(cpu.ForwardAndSample({&on_cpu, 1}, {&params, 1}, &from_cpu).ok());
      same += from_gpu[0].id == from_cpu[0].id;
      ++draws;
      if (from_gpu[0].id == from_cpu[0].id) {
        worst_logprob =
            std::max(worst_logprob, double(std::abs(from_gpu[0].logprob - from_cpu[0].logprob)));
      }
      // Both continue with the CPU's choice, so a rare difference does not compound.
      gpu_tokens.push_back(from_cpu[0].id);
      cpu_tokens.push_back(from_cpu[0].id);
      on_gpu.tokens = std::span(&gpu_tokens.back(), 1);
      on_cpu.tokens = std::span(&cpu_tokens.back(), 1);
    }
  }
  std::printf("[cuda-sampling] same token as the CPU sampler in %d of %d seeded draws; "
              "log-prob max|Δ| %.3g\n", same, draws, worst_logprob);
  EXPECT_GE(same, draws * 95 / 100);
  EXPECT_LE(worst_logprob, 1e-3);
}

class CudaEngineStateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    auto model = LoadModel(testing::TestDataPath("golden/tiny-mlp-m"));
    ASSERT_TRUE(model.ok());
    model_ = *model;
    for (int32_t i = 0; i < 50; ++i) tokens_.push_back((i * 41 + 3) % 512);
  }
  std::vector<float> Feed(Engine& engine, SequenceSlot slot, std::span<const int32_t> tokens) {
    std::vector<float> logits;
    const SequenceChunk chunk{slot, tokens};
    EXPECT_TRUE(engine.Forward({&chunk, 1}, LogitsFor::kEveryToken, &logits).ok());
    return logits;
  }
  std::shared_ptr<const Model> model_;
  std::vector<int32_t> tokens_;
};

TEST_F(CudaEngineStateTest, ForkAndSaveRestoreContinueExactly) {
  auto gpu = MakeCudaEngine(model_, WeightPrecision::kFloat32);
  ASSERT_NE(gpu, nullptr);
  const std::span<const int32_t> all(tokens_);
  const SequenceSlot original = *gpu->CreateSequence();
  Feed(*gpu, original, all.first(19));
  const SequenceSlot fork = *gpu->ForkSequence(original);
  const std::string saved = *gpu->SaveSequence(original);
  const SequenceSlot restored = *gpu->RestoreSequence(saved);
  const std::vector<float> expected = Feed(*gpu, original, all.subspan(19));
  EXPECT_EQ(Feed(*gpu, fork, all.subspan(19)), expected);
  EXPECT_EQ(Feed(*gpu, restored, all.subspan(19)), expected);

  // The saved format is the same on every backend: the CPU engine continues the GPU's state.
  CpuEngine cpu(model_);
  auto on_cpu = cpu.RestoreSequence(saved);
  ASSERT_TRUE(on_cpu.ok()) << on_cpu.status();
  EXPECT_LE(testing::MaxAbsDiff(Feed(cpu, *on_cpu, all.subspan(19)), expected), 1e-4f);
}

// A new sequence's fresh state is written by the next step or fork, for every new sequence at
// once. Until then it saves and forks as a fresh state, and given back it leaves its slot to
// whatever takes it next, here a restored state that the next step must not overwrite.
TEST_F(CudaEngineStateTest, NewSequencesSaveForkAndLeaveBeforeTheirFirstStep) {
  auto gpu = MakeCudaEngine(model_, WeightPrecision::kFloat32);
  ASSERT_NE(gpu, nullptr);
  CpuEngine cpu(model_);
  const std::span<const int32_t> all(tokens_);
  const SequenceSlot fresh_on_cpu = *cpu.CreateSequence(), used_on_cpu = *cpu.CreateSequence();
  const std::vector<float> from_fresh = Feed(cpu, fresh_on_cpu, all.first(20));
  Feed(cpu, used_on_cpu, all.first(30));
  const std::vector<float> continued = Feed(cpu, used_on_cpu, all.subspan(30));

  const SequenceSlot used = *gpu->CreateSequence();
  Feed(*gpu, used, all.first(30));
  const std::string saved_used = *gpu->SaveSequence(used);
  ASSERT_TRUE(gpu->ReleaseSequence(used).ok());
  const SequenceSlot reused = *gpu->CreateSequence();
  ASSERT_EQ(reused, used) << "the test needs the slot given back to be the next one taken";
  const std::string saved_fresh = *gpu->SaveSequence(reused);
  const SequenceSlot fork = *gpu->ForkSequence(reused);
  const SequenceSlot left = *gpu->CreateSequence();
  ASSERT_TRUE(gpu->ReleaseSequence(left).ok());
  const SequenceSlot restored = *gpu->RestoreSequence(saved_used);
  ASSERT_EQ(restored, left) << "the test needs the slot given back to be the next one taken";

  EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, reused, all.first(20)), from_fresh), 1e-3f);
  EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, fork, all.first(20)), from_fresh), 1e-3f);
  const SequenceSlot from_saved = *gpu->RestoreSequence(saved_fresh);
  EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, from_saved, all.first(20)), from_fresh), 1e-3f);
  EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, restored, all.subspan(30)), continued), 1e-3f);
}

// Between StartForwardAndSample and FinishForwardAndSample the step runs on the device while the
// caller goes on: calls on sequences made meanwhile see the step's effect, as on the CPU engine
// where it has already happened. Both kinds of step: decode (one token each, a CUDA graph) and
// prefill chunks.
TEST_F(CudaEngineStateTest, CallsWhileAStepIsInFlightComeAfterIt) {
  auto gpu = MakeCudaEngine(model_, WeightPrecision::kFloat32);
  ASSERT_NE(gpu, nullptr);
  CpuEngine cpu(model_);
  const std::span<const int32_t> all(tokens_);
  const SamplingParams greedy;
  for (const int64_t chunk_tokens : {1, 7}) {
    SCOPED_TRACE(absl::StrCat(chunk_tokens, " tokens per chunk"));
    const SequenceSlot on_gpu = *gpu->CreateSequence(), on_cpu = *cpu.CreateSequence();
    Feed(*gpu, on_gpu, all.first(19));
    Feed(cpu, on_cpu, all.first(19));
    const std::span<const int32_t> next = all.subspan(19, chunk_tokens);
    const SequenceChunk gpu_chunk{on_gpu, next}, cpu_chunk{on_cpu, next};

    ASSERT_TRUE(gpu->StartForwardAndSample({&gpu_chunk, 1}, {&greedy, 1}).ok());
    EXPECT_EQ(*gpu->SequenceLength(on_gpu), 19 + chunk_tokens);
    std::vector<float> logits;
    EXPECT_EQ(gpu->Forward({&gpu_chunk, 1}, LogitsFor::kLastToken, &logits).code(),
              absl::StatusCode::kFailedPrecondition);
    std::vector<SampledToken> refused;
    EXPECT_EQ(gpu->ForwardAndSample({&gpu_chunk, 1}, {&greedy, 1}, &refused).code(),
              absl::StatusCode::kFailedPrecondition);
    const SequenceSlot fork = *gpu->ForkSequence(on_gpu);
    const std::string saved = *gpu->SaveSequence(on_gpu);
    const SequenceSlot fresh = *gpu->CreateSequence();
    std::vector<SampledToken> from_gpu, from_cpu;
    ASSERT_TRUE(gpu->FinishForwardAndSample(&from_gpu).ok());
    ASSERT_TRUE(cpu.ForwardAndSample({&cpu_chunk, 1}, {&greedy, 1}, &from_cpu).ok());
    ASSERT_EQ(from_gpu.size(), 1u);
    EXPECT_EQ(from_gpu[0].id, from_cpu[0].id);
    EXPECT_NEAR(from_gpu[0].logprob, from_cpu[0].logprob, 1e-3);

    // The fork and the saved state hold the step's tokens; the new sequence holds none.
    const std::span<const int32_t> rest = all.subspan(19 + chunk_tokens);
    const std::vector<float> expected = Feed(cpu, on_cpu, rest);
    EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, on_gpu, rest), expected), 1e-3f);
    EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, fork, rest), expected), 1e-3f);
    const SequenceSlot restored = *gpu->RestoreSequence(saved);
    EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, restored, rest), expected), 1e-3f);
    EXPECT_EQ(*gpu->SequenceLength(fresh), 0);
    const SequenceSlot fresh_on_cpu = *cpu.CreateSequence();
    EXPECT_LE(testing::MaxAbsDiff(Feed(*gpu, fresh, rest), Feed(cpu, fresh_on_cpu, rest)), 1e-3f);
    for (SequenceSlot slot : {on_gpu, fork, fresh, restored}) {
      ASSERT_TRUE(gpu->ReleaseSequence(slot).ok());
    }
  }
}

// A step queued behind the one in flight takes that step's tokens on the device: the same tokens
// as feeding them back from the host, through both kinds of step (prompts next to taken tokens;
// decode graphs), across windows, and the same greedy tokens as the CPU engine. On an engine
// prepared at start for such steps, and on one that is not, whose buffers then grow while the
// step whose tokens are taken is in flight.
TEST_F(CudaEngineStateTest, StepsQueuedBehindTheOneInFlightTakeItsTokens) {
  constexpr int kSteps = 40;
  for (const int64_t prepared_for : {0, 32}) {
    for (const SamplingParams& sampling :
         {SamplingParams{}, SamplingParams{.temperature = 1.0f, .top_k = 50}}) {
      SCOPED_TRACE(absl::StrCat("prepared for ", prepared_for, " prompt tokens, temperature ",
                                sampling.temperature));
      auto gpu = CreateCudaEngine(model_, {.precision = WeightPrecision::kFloat32,
                                           .max_sequences = 64,
                                           .prefill_tokens_per_step = prepared_for});
      ASSERT_TRUE(gpu.ok()) << gpu.status();
      const auto got = testing::GenerateScripted(**gpu, /*pipelined=*/true, kSteps, sampling);
      const auto expected = testing::GenerateScripted(**gpu, /*pipelined=*/false, kSteps, sampling);
      ASSERT_EQ(got.size(), expected.size());
      for (size_t step = 0; step < got.size(); ++step) {
        ASSERT_EQ(got[step].size(), expected[step].size());
        for (size_t b = 0; b < got[step].size(); ++b) {
          EXPECT_EQ(got[step][b].id, expected[step][b].id) << "step " << step << " row " << b;
          EXPECT_NEAR(got[step][b].logprob, expected[step][b].logprob, 1e-5);
        }
      }
      if (sampling.temperature == 0.0f) {
        CpuEngine cpu(model_);
        const auto on_cpu = testing::GenerateScripted(cpu, /*pipelined=*/false, kSteps, sampling);
        for (size_t step = 0; step < got.size(); ++step) {
          for (size_t b = 0; b < got[step].size(); ++b) {
            EXPECT_EQ(got[step][b].id, on_cpu[step][b].id) << "step " << step << " row " << b;
          }
        }
      }
      // The device's time on the last step collected is measured.
      ASSERT_TRUE((*gpu)->CollectedStepDeviceTime().has_value());
      EXPECT_GT(*(*gpu)->CollectedStepDeviceTime(), absl::ZeroDuration());
    }
  }
}

// Steps in which new sequences join others that decode, as a server's steps take arriving
// requests. `stayers` sequences decode in every step; before each step but every third one or
// two sequences join with prompts of 2–5 tokens (and decode from then on), and as many of the
// earlier joiners leave, their slots then taken by later ones. The batch's chunks come in a
// shuffled order. Greedy; with `pipelined` each step is started before the one in
// flight is finished, its single tokens taking that step's. Returns each step's tokens by
// sequence: the stayers', then the joiners' in the order they joined.
std::vector<std::map<int, SampledToken>> RunWithJoiners(Engine& engine, int stayers, int steps,
                                                        bool pipelined,
                                                        int* replayed_graphs = nullptr) {
  const int32_t vocab = static_cast<int32_t>(engine.config().vocab_size);
  std::mt19937 rng(7);  // The same steps on every engine.
  std::uniform_int_distribution<int32_t> token(0, vocab - 1);
  struct Sequence {
    SequenceSlot slot;
    std::vector<int32_t> prompt;  // Fed in the step it joins.
    int32_t last = -1;            // Its latest token on the host.
  };
  std::map<int, Sequence> live;  // By index, as returned.
  int next_index = 0;
  auto join = [&](int prompt_tokens) {
    Sequence sequence{.slot = *engine.CreateSequence(), .prompt = {}, .last = -1};
    for (int i = 0; i < prompt_tokens; ++i) sequence.prompt.push_back(token(rng));
    live.emplace(next_index++, std::move(sequence));
  };
  for (int i = 0; i < stayers; ++i) join(3 + i % 4);
  std::vector<std::map<int, SampledToken>> chosen;
  std::vector<std::vector<int>> in_flight;  // The unfinished steps' chunks' sequences, in order.
  auto finish = [&] {
    std::vector<SampledToken> tokens;
    const absl::Status status = engine.FinishForwardAndSample(&tokens);
    EXPECT_TRUE(status.ok()) << status;
    if (replayed_graphs != nullptr) *replayed_graphs += *engine.CollectedStepReplayedGraph();
    const std::vector<int> order = std::move(in_flight.front());
    in_flight.erase(in_flight.begin());
    EXPECT_EQ(tokens.size(), order.size());
    std::map<int, SampledToken>& step = chosen.emplace_back();
    for (size_t b = 0; b < order.size() && b < tokens.size(); ++b) {
      step[order[b]] = tokens[b];
      if (live.contains(order[b])) live.at(order[b]).last = tokens[b].id;
    }
  };
  for (int step = 0; step < steps; ++step) {
    if (step > 0 && step % 3 != 0) {
      const int count = 1 + step % 2;
      for (int j = 0; j < count && std::ssize(live) > stayers + 2; ++j) {
        auto leaving = live.upper_bound(stayers - 1);  // The earliest joiner still decoding.
        EXPECT_TRUE(engine.ReleaseSequence(leaving->second.slot).ok());
        live.erase(leaving);
      }
      for (int j = 0; j < count; ++j) join(2 + (step + j) % 4);
    }
    std::vector<int> order;
    for (const auto& [index, sequence] : live) order.push_back(index);
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<SequenceChunk> batch;
    for (int index : order) {
      Sequence& sequence = live.at(index);
      if (!sequence.prompt.empty()) {
        batch.push_back({sequence.slot, sequence.prompt});
      } else if (pipelined) {
        batch.push_back({.slot = sequence.slot, .tokens = {}, .takes_token_in_flight = true});
      } else {
        batch.push_back({sequence.slot, std::span(&sequence.last, 1)});
      }
    }
    const std::vector<SamplingParams> greedy(batch.size());
    const absl::Status status = engine.StartForwardAndSample(batch, greedy);
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) return chosen;
    for (int index : order) live.at(index).prompt.clear();
    in_flight.push_back(std::move(order));
    if (!pipelined || step > 0) finish();
  }
  if (pipelined) finish();
  for (const auto& [index, sequence] : live) {
    EXPECT_TRUE(engine.ReleaseSequence(sequence.slot).ok());
  }
  return chosen;
}

// TTT-Linear (the decode kernel) and TTT-MLP (the scan in the decode graph), every backbone flag.
std::shared_ptr<const Model> JoinersModel(TttLayerType inner) {
  ModelConfig c = SequenceStepModel(/*flags=*/7, /*head_dim=*/64);
  c.ttt_layer_type = inner;
  c.ttt_base_lr = inner == TttLayerType::kMlp ? 0.1 : 1.0;
  return testing::RandomModel(c, 31);
}

// Joining sequences' steps (two in flight, as the server runs them) choose the CPU engine's
// tokens, the joiners' first tokens among them, each in its chunk's place in the batch: kernel by
// kernel, and as the graphs an engine prepared for a prefill budget captured at start.
TEST(CudaJoinersTest, StepsThatTakeJoinersChooseTheCpuEnginesTokens) {
  SKIP_WITHOUT_GPU();
  for (const TttLayerType inner : {TttLayerType::kLinear, TttLayerType::kMlp}) {
    const auto model = JoinersModel(inner);
    CpuEngine cpu(model);
    const int steps = DecodeSteps(40);
    const auto expected = RunWithJoiners(cpu, 10, steps, /*pipelined=*/false);
    for (const int64_t prefill_budget : {0, 64}) {
      SCOPED_TRACE(absl::StrCat(inner == TttLayerType::kMlp ? "mlp" : "linear",
                                ", prefill budget ", prefill_budget));
      auto gpu = MakeCudaEngine(model, WeightPrecision::kFloat32, 64, prefill_budget);
      ASSERT_NE(gpu, nullptr);
      int replayed_graphs = 0;
      const auto got = RunWithJoiners(*gpu, 10, steps, /*pipelined=*/true, &replayed_graphs);
      ASSERT_EQ(got.size(), expected.size());
      int tokens = 0;
      for (size_t step = 0; step < got.size(); ++step) {
        ASSERT_EQ(got[step].size(), expected[step].size()) << "step " << step;
        for (const auto& [index, want] : expected[step]) {
          ASSERT_TRUE(got[step].contains(index)) << "step " << step << " sequence " << index;
          EXPECT_EQ(got[step].at(index).id, want.id) << "step " << step << " sequence " << index;
          EXPECT_NEAR(got[step].at(index).logprob, want.logprob, 1e-4);
          ++tokens;
        }
      }
      EXPECT_GT(tokens, steps * 10);
      // The first step (prompts alone) launches kernel by kernel; every third step after it
      // takes no joiner (a decode graph); the others mix prompts in, as graphs when prepared.
      const int decode_steps = (steps - 1) / 3;
      EXPECT_EQ(replayed_graphs, prefill_budget > 0 ? steps - 1 : decode_steps);
    }
  }
}

// A step's decoding sequences and the prompts that join them (CudaEngine::MixedBucket).
struct MixedShape {
  int decode, prompts, prompt_tokens;
  bool replays_graph;  // Whether the engine below has a graph for its bucket.
};

// For each shape: `decode` sequences take a prompt of their own, alone, then `rounds` steps mix
// their next tokens with `prompts` new sequences' prompts (which leave after their step); the
// GPU engine, prepared for a prefill budget of 64 tokens, chooses the CPU engine's tokens at
// every step, and runs the mixed steps as graphs where the shape says.
void ExpectMixedStepsChooseTheCpuEnginesTokens(const std::shared_ptr<const Model>& model,
                                               std::span<const MixedShape> shapes, int rounds) {
  auto gpu = MakeCudaEngine(model, WeightPrecision::kFloat32, 64, /*prefill_tokens_per_step=*/64);
  ASSERT_NE(gpu, nullptr);
  CpuEngine cpu(model);
  const int32_t vocab = static_cast<int32_t>(model->config.vocab_size);
  for (const MixedShape& shape : shapes) {
    SCOPED_TRACE(absl::StrCat(shape.decode, " decoding, ", shape.prompts, " prompts of ",
                              shape.prompt_tokens));
    std::mt19937 rng(shape.decode * 100 + shape.prompts);
    std::uniform_int_distribution<int32_t> token(0, vocab - 1);
    auto prompt = [&](int n) {
      std::vector<int32_t> tokens(n);
      for (int32_t& t : tokens) t = token(rng);
      return tokens;
    };
    std::vector<SequenceSlot> on_gpu, on_cpu;
    std::vector<std::vector<int32_t>> chunks;
    for (int i = 0; i < shape.decode; ++i) {
      on_gpu.push_back(*gpu->CreateSequence());
      on_cpu.push_back(*cpu.CreateSequence());
      chunks.push_back(prompt(3 + i % 5));
    }
    auto step = [&](std::span<const std::vector<int32_t>> tokens) {
      std::vector<SequenceChunk> gpu_batch, cpu_batch;
      for (size_t b = 0; b < tokens.size(); ++b) {
        gpu_batch.push_back({on_gpu[b], tokens[b]});
        cpu_batch.push_back({on_cpu[b], tokens[b]});
      }
      const std::vector<SamplingParams> params(tokens.size());
      std::vector<SampledToken> from_gpu, from_cpu;
      EXPECT_TRUE(gpu->ForwardAndSample(gpu_batch, params, &from_gpu).ok());
      EXPECT_TRUE(cpu.ForwardAndSample(cpu_batch, params, &from_cpu).ok());
      EXPECT_EQ(from_gpu.size(), from_cpu.size());
      for (size_t b = 0; b < from_gpu.size() && b < from_cpu.size(); ++b) {
        EXPECT_EQ(from_gpu[b].id, from_cpu[b].id) << "row " << b;
        EXPECT_NEAR(from_gpu[b].logprob, from_cpu[b].logprob, 1e-4) << "row " << b;
      }
      return from_cpu;
    };
    std::vector<SampledToken> last = step(chunks);
    for (int round = 0; round < rounds; ++round) {
      std::vector<std::vector<int32_t>> mixed;
      for (int i = 0; i < shape.decode; ++i) mixed.push_back({last[i].id});
      for (int j = 0; j < shape.prompts; ++j) {
        on_gpu.push_back(*gpu->CreateSequence());
        on_cpu.push_back(*cpu.CreateSequence());
        mixed.push_back(prompt(shape.prompt_tokens));
      }
      last = step(mixed);
      EXPECT_EQ(gpu->CollectedStepReplayedGraph(), shape.replays_graph);
      for (int j = 0; j < shape.prompts; ++j) {
        EXPECT_TRUE(gpu->ReleaseSequence(on_gpu.back()).ok());
        EXPECT_TRUE(cpu.ReleaseSequence(on_cpu.back()).ok());
        on_gpu.pop_back();
        on_cpu.pop_back();
      }
    }
    for (size_t b = 0; b < on_gpu.size(); ++b) {
      EXPECT_TRUE(gpu->ReleaseSequence(on_gpu[b]).ok());
      EXPECT_TRUE(cpu.ReleaseSequence(on_cpu[b]).ok());
    }
  }
}

// Steps that mix prompts into decode rows run as graphs by bucket (CudaEngine::MixedBucket), with
// rows that fill their bucket and rows that leave padding, and padding segments of both kinds;
// steps past the buckets (more than 16 prompts; more rows than any bucket of their decode rows
// holds, with a budget of 64) run kernel by kernel.
TEST(CudaJoinersTest, MixedStepsAtTheirBucketsEdgesChooseTheCpuEnginesTokens) {
  SKIP_WITHOUT_GPU();
  const MixedShape shapes[] = {
      {3, 1, 61, true},    // 64 rows and 4 segments: no padding.
      {9, 2, 7, true},     // 23 rows: a bucket of 32; 16 segments, 14 of them decode ones.
      {5, 3, 2, true},     // 11 rows: 16; 16 segments: 12 decode, 4 scanned (one empty).
      {33, 5, 6, true},    // 63 rows: 64; 64 segments: 8 scanned or the ladder's step.
      {5, 17, 2, false},   // 17 prompts.
      {1, 1, 200, false},  // 201 rows: 256, past the 128 that one decode row and 64 prompt rows
                           // take.
  };
  for (const TttLayerType inner : {TttLayerType::kLinear, TttLayerType::kMlp}) {
    SCOPED_TRACE(inner == TttLayerType::kMlp ? "mlp" : "linear");
    ExpectMixedStepsChooseTheCpuEnginesTokens(JoinersModel(inner), shapes, /*rounds=*/2);
  }
}

TEST_F(CudaEngineStateTest, TakingATokenWithNothingInFlightIsRefused) {
  auto gpu = MakeCudaEngine(model_, WeightPrecision::kFloat32);
  ASSERT_NE(gpu, nullptr);
  const SequenceSlot slot = *gpu->CreateSequence();
  const SequenceChunk takes{.slot = slot, .tokens = {}, .takes_token_in_flight = true};
  const SamplingParams greedy;
  const absl::Status status = gpu->StartForwardAndSample({&takes, 1}, {&greedy, 1});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("batch[0].takes_token_in_flight"), std::string_view::npos)
      << status;
  EXPECT_EQ(*gpu->SequenceLength(slot), 0);
}

TEST_F(CudaEngineStateTest, APoolLargerThanTheGpuIsAClearErrorAtStart) {
  auto engine = CreateCudaEngine(model_, {.max_sequences = int64_t{1} << 40});
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(engine.status().message().find("state pool"), std::string_view::npos)
      << engine.status();
}

TEST_F(CudaEngineStateTest, PoolLimitAndBadInputs) {
  auto gpu = MakeCudaEngine(model_, WeightPrecision::kBFloat16, /*max_sequences=*/2);
  ASSERT_NE(gpu, nullptr);
  const SequenceSlot a = *gpu->CreateSequence();
  ASSERT_TRUE(gpu->CreateSequence().ok());
  EXPECT_EQ(gpu->CreateSequence().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(gpu->ForkSequence(a).status().code(), absl::StatusCode::kResourceExhausted);
  const std::vector<int32_t> bad = {1, 512};
  std::vector<float> logits;
  const SequenceChunk chunk{a, bad};
  EXPECT_EQ(gpu->Forward({&chunk, 1}, LogitsFor::kLastToken, &logits).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*gpu->SequenceLength(a), 0);
  ASSERT_TRUE(gpu->ReleaseSequence(a).ok());
  EXPECT_TRUE(gpu->CreateSequence().ok());
}

}  // namespace
}  // namespace ttt
