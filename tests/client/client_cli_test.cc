// ttt-client against a real server: its output, its error messages and its exit codes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tests/server/test_server.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

class ClientCliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<testing::TestServer>(testing::TestServerOptions{
        .model_dir = testing::TestDataPath("golden/tiny-linear-m"), .max_sequences = 8,
        .scheduler = {}});
  }
  testing::CommandResult Client(const std::string& args) {
    return testing::RunCommand(
        absl::StrCat(TTT_CLIENT_BINARY, " --server ", server_->target(), " ", args));
  }
  std::unique_ptr<testing::TestServer> server_;
};

TEST_F(ClientCliTest, GenerateStreamsTheGreedyTokens) {
  const testing::Golden golden = testing::LoadGolden("tiny-linear-m");
  const testing::CommandResult run = Client(absl::StrCat(
      "generate --prompt-ids ", absl::StrJoin(golden.input_ids[0], ","),
      " --temperature 0 --ignore-eos --print-ids --max-new-tokens ", golden.greedy_steps));
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr(absl::StrJoin(golden.greedy_ids[0], " ")));
  EXPECT_THAT(run.output, HasSubstr("FINISH_REASON_LENGTH"));
}

TEST_F(ClientCliTest, SessionsAndErrorsByExitCode) {
  EXPECT_EQ(Client("session create talk").exit_code, 0);
  testing::CommandResult run =
      Client("generate --session talk --prompt-ids 1,2,3 --max-new-tokens 4 --print-ids");
  EXPECT_EQ(run.exit_code, 0) << run.output;
  run = Client("session info talk");
  EXPECT_THAT(run.output, HasSubstr("session talk: 7 tokens absorbed"));
  run = Client("session info nobody");
  EXPECT_EQ(run.exit_code, 3);
  EXPECT_THAT(run.output, HasSubstr("NOT_FOUND: session_id: no session 'nobody'"));
  run = Client("generate --prompt-ids 1,2 --top-p 7");
  EXPECT_EQ(run.exit_code, 2);
  EXPECT_THAT(run.output, HasSubstr("INVALID_ARGUMENT: sampling.top_p"));
  run = Client("health");
  EXPECT_EQ(run.exit_code, 0);
  EXPECT_THAT(run.output, HasSubstr("SERVING"));
}

}  // namespace
}  // namespace ttt
