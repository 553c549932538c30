// ttt-bench on the CPU engine, run as bench/served.sh, bench/compare.sh and bench/record.sh run
// it: one JSON object a configuration, with the fields they read, for every way of queueing the
// steps, which all choose the same tokens; and its errors, naming the flag.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// The model of the CPU engine's recorded benchmark (bench/README.md).
std::string ModelArg() {
  return "--backend cpu --model " + testing::TestDataPath("golden/small-linear-m64");
}

testing::CommandResult RunBench(const std::string& args) {
  return testing::RunCommand(absl::StrCat(TTT_BENCH_BINARY, " ", ModelArg(), " ", args));
}

// The output's JSON lines (errors and warnings go to the same stream: they start otherwise).
std::vector<nlohmann::json> Results(const std::string& output) {
  std::vector<nlohmann::json> results;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (line.starts_with("{")) results.push_back(nlohmann::json::parse(line));
  }
  return results;
}

void ExpectTimings(const nlohmann::json& result) {
  EXPECT_EQ(result.at("backend"), "cpu");
  EXPECT_EQ(result.at("model"), "small-linear-m64");
  EXPECT_GT(result.at("tokens_per_s").get<double>(), 0);
  EXPECT_GT(result.at("tokens_per_s_mean").get<double>(), 0);
  EXPECT_GT(result.at("step_ms_p50").get<double>(), 0);
  EXPECT_GE(result.at("step_ms_p99").get<double>(), result.at("step_ms_p50").get<double>());
  EXPECT_GT(result.at("prefill_tokens_per_s").get<double>(), 0);
  EXPECT_GT(result.at("first_prefill_tokens_per_s").get<double>(), 0);
  EXPECT_GT(result.at("state_bytes_per_sequence").get<int64_t>(), 0);
  EXPECT_GT(result.at("weight_bytes").get<int64_t>(), 0);
  // tokens_per_s is the batch over the median step.
  EXPECT_NEAR(result.at("tokens_per_s").get<double>() * result.at("step_ms_p50").get<double>(),
              1e3 * result.at("batch").get<int>(), 1e-6 * result.at("batch").get<int>() * 1e3);
  EXPECT_THAT(result.at("tokens_digest").get<std::string>(), MatchesRegex("[0-9a-f]{16}"));
}

TEST(BenchToolTest, OneResultForEachBatch) {
  const testing::CommandResult run = RunBench("--batch 1,3 --steps 6 --warmup 1 --offset 5");
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const std::vector<nlohmann::json> results = Results(run.output);
  ASSERT_EQ(results.size(), 2u) << run.output;
  for (int i = 0; i < 2; ++i) {
    SCOPED_TRACE(results[i].dump());
    EXPECT_EQ(results[i].at("batch"), i == 0 ? 1 : 3);
    EXPECT_EQ(results[i].at("steps"), 6);
    EXPECT_EQ(results[i].at("offset"), 5);
    EXPECT_EQ(results[i].at("steps_in_flight"), 1);
    EXPECT_EQ(results[i].at("staggered"), false);
    EXPECT_EQ(results[i].at("joining"), 0);
    ExpectTimings(results[i]);
  }
}

// Steps queued one at a time and two at a time (the next before the last is collected, its rows
// taking that step's tokens on the engine), with sequences at spread offsets and new ones joining
// every step, as a server's steps are: the same tokens either way, and other tokens (greedy ones)
// tell in the digest.
TEST(BenchToolTest, StepsQueuedAsTheServerQueuesThem) {
  struct Queueing {
    int steps_in_flight;
    double temperature;
  };
  std::vector<std::string> digests;
  for (const Queueing& q : std::vector<Queueing>{{1, 1.0}, {2, 1.0}, {2, 0.0}}) {
    SCOPED_TRACE(
        absl::StrCat("--steps_in_flight ", q.steps_in_flight, " --temperature ", q.temperature));
    const testing::CommandResult run = RunBench(absl::StrCat(
        "--batch 4 --steps 6 --warmup 2 --offset 5 --staggered --joining 1 --joining_prompt 3",
        " --steps_in_flight ", q.steps_in_flight, " --temperature ", q.temperature));
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const std::vector<nlohmann::json> results = Results(run.output);
    ASSERT_EQ(results.size(), 1u) << run.output;
    EXPECT_EQ(results[0].at("steps_in_flight"), q.steps_in_flight);
    EXPECT_EQ(results[0].at("staggered"), true);
    EXPECT_EQ(results[0].at("joining"), 1);
    EXPECT_EQ(results[0].at("joining_prompt"), 3);
    EXPECT_EQ(results[0].at("temperature"), q.temperature);
    ExpectTimings(results[0]);
    digests.push_back(results[0].at("tokens_digest"));
  }
  EXPECT_EQ(digests[0], digests[1]) << "steps queued two at a time chose other tokens";
  EXPECT_NE(digests[1], digests[2]) << "greedy and sampled tokens gave one digest";
}

// Truncation as a server's requests ask for it: the settings come back in the JSON, and keeping
// two tokens a step chooses other tokens than drawing from all of them.
TEST(BenchToolTest, TruncatedSamplingIsTimedAndReported) {
  std::vector<std::string> digests;
  for (const std::string truncation : {"", " --top_k 2 --top_p 0.9 --min_p 0.05"}) {
    SCOPED_TRACE(truncation);
    const testing::CommandResult run =
        RunBench("--batch 4 --steps 6 --warmup 1 --offset 5 --temperature 1" + truncation);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const std::vector<nlohmann::json> results = Results(run.output);
    ASSERT_EQ(results.size(), 1u) << run.output;
    const bool truncated = !truncation.empty();
    EXPECT_EQ(results[0].at("top_k"), truncated ? 2 : 0);
    EXPECT_FLOAT_EQ(results[0].at("top_p").get<float>(), truncated ? 0.9f : 1.0f);
    EXPECT_FLOAT_EQ(results[0].at("min_p").get<float>(), truncated ? 0.05f : 0.0f);
    ExpectTimings(results[0]);
    digests.push_back(results[0].at("tokens_digest"));
  }
  EXPECT_NE(digests[0], digests[1]) << "top-k 2 chose the tokens of sampling from all";
}

TEST(BenchToolTest, BadFlagsAreClearErrors) {
  struct Case {
    std::string args, flag;
  };
  for (const Case& c :
       std::vector<Case>{{"--batch 4 --steps_in_flight 3", "--steps_in_flight"},
                         {"--batch 4 --joining 5", "--joining"},
                         {"--batch 4 --joining 1 --joining_prompt 0", "--joining_prompt"},
                         {"--batch 4 --temperature 1 --top_k -1", "top_k"},
                         {"--batch 4 --temperature 1 --top_p 0", "top_p"},
                         {"--batch 4 --temperature 1 --min_p 2", "min_p"}}) {
    const testing::CommandResult run = RunBench(c.args);
    EXPECT_NE(run.exit_code, 0) << c.args;
    EXPECT_THAT(run.output, HasSubstr(c.flag)) << c.args;
    EXPECT_TRUE(Results(run.output).empty()) << run.output;
  }
}

}  // namespace
}  // namespace ttt
