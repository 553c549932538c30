#include "tests/test_support.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include "server/model/safetensors.h"

namespace ttt::testing {
namespace {

template <typename T>
std::vector<T> ReadTensor(const SafetensorsFile& file, const std::string& name, DType dtype) {
  const TensorView* view = file.Find(name);
  if (view == nullptr || view->dtype != dtype) {
    ADD_FAILURE() << file.path() << ": no " << DTypeName(dtype) << " tensor " << name;
    return {};
  }
  std::vector<T> values(view->num_elements());
  std::memcpy(values.data(), view->bytes.data(), view->bytes.size());
  return values;
}

std::vector<std::vector<int32_t>> Rows(const std::vector<int64_t>& values, int64_t rows) {
  std::vector<std::vector<int32_t>> out(rows);
  const int64_t cols = rows > 0 ? static_cast<int64_t>(values.size()) / rows : 0;
  for (int64_t r = 0; r < rows; ++r) {
    out[r].assign(values.begin() + r * cols, values.begin() + (r + 1) * cols);
  }
  return out;
}

}  // namespace

std::string TestDataPath(const std::string& relative) {
  return std::string(TTT_TEST_DATA_DIR) + "/" + relative;
}

std::vector<std::string> GoldenModelNames() {
  return {"tiny-linear-m", "tiny-linear-t", "tiny-mlp-m", "small-linear-m64"};
}

Golden LoadGolden(const std::string& model_name) {
  Golden golden;
  auto file = SafetensorsFile::Open(TestDataPath("golden/" + model_name + "/golden.safetensors"));
  if (!file.ok()) {
    ADD_FAILURE() << file.status();
    return golden;
  }
  const SafetensorsFile& f = **file;
  const TensorView* ids = f.Find("input_ids");
  const TensorView* greedy = f.Find("greedy_ids");
  const TensorView* logits = f.Find("prefill_logits");
  if (ids == nullptr || greedy == nullptr || logits == nullptr) {
    ADD_FAILURE() << f.path() << " lacks input_ids, greedy_ids or prefill_logits";
    return golden;
  }
  golden.batch = ids->shape[0];
  golden.length = ids->shape[1];
  golden.vocab = logits->shape[2];
  golden.greedy_steps = greedy->shape[1];
  golden.prefill_len = std::stoll(f.metadata().at("prefill_len"));
  golden.input_ids = Rows(ReadTensor<int64_t>(f, "input_ids", DType::kI64), golden.batch);
  golden.greedy_ids = Rows(ReadTensor<int64_t>(f, "greedy_ids", DType::kI64), golden.batch);
  golden.prefill_logits = ReadTensor<float>(f, "prefill_logits", DType::kF32);
  golden.decode_logits = ReadTensor<float>(f, "decode_logits", DType::kF32);
  golden.greedy_logits = ReadTensor<float>(f, "greedy_logits", DType::kF32);
  return golden;
}

std::shared_ptr<const Model> RandomModel(const ModelConfig& config, uint64_t seed,
                                         const std::string& name) {
  return std::make_shared<const Model>(
      Model{name, config, ModelWeights::Random(config, seed), nullptr});
}

float MaxAbsDiff(std::span<const float> a, std::span<const float> b) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const float d = std::abs(a[i] - b[i]);
    if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
  }
  return worst;
}

CommandResult RunCommand(const std::string& command_line) {
  FILE* pipe = popen((command_line + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::string output;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof buffer, pipe)) > 0) output.append(buffer, n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

std::string ScratchDir() {
  static std::atomic<int> counter{0};
  const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = std::string(test->test_suite_name()) + "." + test->name();
  std::replace(name.begin(), name.end(), '/', '_');
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) /
                                    ("ttt-" + std::to_string(::getpid()) + "-" + name + "-" +
                                     std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::vector<float> FeedInChunks(Engine& engine, SequenceSlot slot, std::span<const int32_t> tokens,
                                const std::vector<int64_t>& chunk_sizes) {
  std::vector<float> all, logits;
  size_t at = 0;
  for (size_t i = 0; at < tokens.size(); ++i) {
    const size_t n = std::min<size_t>(chunk_sizes[i % chunk_sizes.size()], tokens.size() - at);
    const SequenceChunk chunk{slot, tokens.subspan(at, n)};
    const absl::Status status = engine.Forward({&chunk, 1}, LogitsFor::kEveryToken, &logits);
    EXPECT_TRUE(status.ok()) << status;
    all.insert(all.end(), logits.begin(), logits.end());
    at += n;
  }
  return all;
}

std::vector<std::vector<SampledToken>> GenerateScripted(Engine& engine, bool pipelined, int steps,
                                                        const SamplingParams& sampling) {
  const int32_t vocab = static_cast<int32_t>(engine.config().vocab_size);
  auto prompt = [vocab](int n, int salt) {
    std::vector<int32_t> tokens;
    for (int i = 0; i < n; ++i) tokens.push_back((i * 41 + salt * 7 + 3) % vocab);
    return tokens;
  };
  const std::vector<std::vector<int32_t>> prompts = {prompt(5, 0), prompt(17, 1), prompt(3, 2),
                                                     prompt(40, 3), prompt(9, 4)};
  std::vector<SequenceSlot> slots;
  std::vector<SamplingParams> params;
  for (size_t i = 0; i < prompts.size(); ++i) {
    slots.push_back(*engine.CreateSequence());
    params.push_back(sampling);
    params.back().seed = 100 + i;
  }
  // Each sequence's latest token on the host (sequence i is row i of every step it is in).
  std::vector<int32_t> last(prompts.size());
  std::vector<std::vector<SampledToken>> chosen;
  auto finish = [&] {
    std::vector<SampledToken> tokens;
    const absl::Status status = engine.FinishForwardAndSample(&tokens);
    EXPECT_TRUE(status.ok()) << status;
    for (size_t b = 0; b < tokens.size() && b < last.size(); ++b) last[b] = tokens[b].id;
    chosen.push_back(std::move(tokens));
  };
  for (int step = 0; step < steps; ++step) {
    std::vector<SequenceChunk> batch;
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int starts = i >= 3 ? 1 : 0;  // The step that feeds sequence i's prompt.
      if (step < starts) continue;
      if (step == starts) {
        batch.push_back({slots[i], prompts[i]});
      } else if (pipelined) {
        batch.push_back({.slot = slots[i], .tokens = {}, .takes_token_in_flight = true});
      } else {
        batch.push_back({slots[i], std::span(&last[i], 1)});
      }
    }
    const absl::Status status =
        engine.StartForwardAndSample(batch, std::span(params).first(batch.size()));
    EXPECT_TRUE(status.ok()) << status;
    if (!status.ok()) break;
    if (!pipelined || step > 0) finish();
  }
  if (pipelined) finish();
  for (SequenceSlot slot : slots) EXPECT_TRUE(engine.ReleaseSequence(slot).ok());
  return chosen;
}

}  // namespace ttt::testing
