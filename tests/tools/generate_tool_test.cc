// ttt-generate, run as a user would: its --logits-out file and greedy output against the golden
// vectors, and its errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "server/model/safetensors.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

testing::CommandResult RunGenerate(const std::string& args) {
  return testing::RunCommand(absl::StrCat(TTT_GENERATE_BINARY, " ", args));
}

class GenerateToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    golden_ = testing::LoadGolden("tiny-linear-m");
    model_arg_ = "--model " + testing::TestDataPath("golden/tiny-linear-m");
    prompt_arg_ = "--prompt-ids " + absl::StrJoin(golden_.input_ids[0], ",");
  }
  testing::Golden golden_;
  std::string model_arg_, prompt_arg_;
};

TEST_F(GenerateToolTest, LogitsOutMatchesTheReferenceForEveryChunking) {
  for (int chunk : {0, 1, 5, 16}) {
    const std::string out = testing::ScratchDir() + "/logits.safetensors";
    const testing::CommandResult run =
        RunGenerate(absl::StrCat(model_arg_, " ", prompt_arg_, " --chunk ", chunk,
                                 " --max-new-tokens 0 --logits-out ", out));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    auto file = SafetensorsFile::Open(out);
    ASSERT_TRUE(file.ok()) << file.status();
    const TensorView* logits = (*file)->Find("logits");
    ASSERT_NE(logits, nullptr);
    EXPECT_EQ(logits->dtype, DType::kF32);
    EXPECT_EQ(logits->shape, (std::vector<int64_t>{golden_.length, golden_.vocab}));
    std::span<const float> values(reinterpret_cast<const float*>(logits->bytes.data()),
                                  logits->num_elements());
    EXPECT_LE(testing::MaxAbsDiff(values, std::span(golden_.prefill_logits)
                                              .first(golden_.length * golden_.vocab)),
              1e-3f)
        << "--chunk " << chunk;
  }
}

TEST_F(GenerateToolTest, GreedyIdsMatchTheReference) {
  const testing::CommandResult run =
      RunGenerate(absl::StrCat(model_arg_, " ", prompt_arg_, " --print-ids",
                               " --ignore-eos --max-new-tokens ", golden_.greedy_steps));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::string first_line = run.output.substr(0, run.output.find('\n'));
  EXPECT_EQ(first_line, absl::StrJoin(golden_.greedy_ids[0], " "));
}

TEST_F(GenerateToolTest, SamplingIsReproducibleBySeed) {
  const std::string args =
      absl::StrCat(model_arg_, " ", prompt_arg_, " --print-ids --max-new-tokens 20 --ignore-eos",
                   " --temperature 1.0 --top-p 0.9");
  const testing::CommandResult a = RunGenerate(args + " --seed 1"),
                               b = RunGenerate(args + " --seed 1");
  const testing::CommandResult c = RunGenerate(args + " --seed 2");
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto ids = [](const testing::CommandResult& r) {
    return r.output.substr(0, r.output.find('\n'));
  };
  EXPECT_EQ(ids(a), ids(b));
  EXPECT_NE(ids(a), ids(c));
}

TEST_F(GenerateToolTest, BadInputsExitNonZeroNamingTheFlag) {
  struct Case {
    std::string args, message;
  };
  const Case cases[] = {
      {model_arg_ + " --prompt-ids ''", "--prompt / --prompt-ids: the prompt is empty"},
      {model_arg_ + " --prompt-ids 1,2,512", "--prompt-ids: id 512"},
      {model_arg_ + " --prompt-ids 1,x", "--prompt-ids: 'x'"},
      {model_arg_ + " --prompt hello", "has no tokenizer"},
      {model_arg_ + " --prompt-ids 1 --temperature -1", "temperature"},
      {"--model /nonexistent --prompt-ids 1", "/nonexistent/config.json"},
  };
  for (const Case& c : cases) {
    const testing::CommandResult run = RunGenerate(c.args);
    EXPECT_EQ(run.exit_code, 1) << c.args << "\n" << run.output;
    EXPECT_THAT(run.output, HasSubstr(c.message)) << c.args;
  }
}

}  // namespace
}  // namespace ttt
