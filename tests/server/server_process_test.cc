// ttt-server as a process: it starts, reports health, serves, and drains on SIGTERM.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "tests/server/test_server.h"
#include "tests/test_support.h"
#include "ttt/v1/ttt.grpc.pb.h"

namespace ttt {
namespace {

// grpc.health.v1.Health/Check through the generic stub: an empty request (service "") and a
// response whose field 1 is the status (1: SERVING, 2: NOT_SERVING); -1 when the call fails.
int HealthStatus(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  grpc::ByteBuffer request, response;
  grpc::Slice empty;
  request = grpc::ByteBuffer(&empty, 1);
  grpc::CompletionQueue queue;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> call =
      stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &queue);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag;
  bool ok;
  queue.Next(&tag, &ok);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  if (!status.ok()) return -1;
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& slice : slices)
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
}

TEST(ServerProcessTest, ServesThenDrainsOnSigterm) {
  const int port = testing::FreePort(), metrics_port = testing::FreePort();
  const std::string model = testing::TestDataPath("golden/tiny-linear-m");
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string port_flag = absl::StrCat("--port=", port);
    const std::string metrics_flag = absl::StrCat("--metrics-port=", metrics_port);
    const std::string model_flag = "--model=" + model;
    execl(TTT_SERVER_BINARY, TTT_SERVER_BINARY, model_flag.c_str(), port_flag.c_str(),
          metrics_flag.c_str(), "--host=127.0.0.1", "--backend=cpu", "--drain-grace-seconds=1.5",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port),
                                     grpc::InsecureChannelCredentials());
  int health = -1;
  for (int i = 0; i < 200 && health != 1; ++i) {
    health = HealthStatus(channel);
    if (health != 1) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(health, 1) << "the server never reported SERVING";

  // A generation longer than the grace period is in flight when SIGTERM arrives: new work is
  // refused at once, the generation runs on until the grace period ends and is then cancelled.
  auto stub = v1::TttService::NewStub(channel);
  v1::GenerateRequest request;
  request.mutable_token_ids()->add_ids(1);
  request.mutable_sampling()->set_temperature(0);
  request.mutable_stopping()->set_max_new_tokens(100'000'000);
  request.mutable_stopping()->set_ignore_eos(true);
  grpc::ClientContext context;
  auto reader = stub->Generate(&context, request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(HealthStatus(channel), 2);  // NOT_SERVING while draining.
  grpc::ClientContext late_context;
  v1::CompleteResponse late;
  request.mutable_stopping()->set_max_new_tokens(2);
  EXPECT_EQ(stub->Complete(&late_context, request, &late).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  const absl::Time signalled = absl::Now();
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  while (reader->Read(&response)) {
    if (response.has_usage()) finish = response.finish_reason();
  }
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_EQ(finish, v1::FINISH_REASON_CANCELLED);
  EXPECT_GE(absl::Now() - signalled, absl::Seconds(1));  // It ran on through the grace period.

  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

// A flag with a value it does not know stops the server at start, exit status 1, and its message
// names the flag.
TEST(ServerProcessTest, AnUnknownFlagValueStopsItAtStartNamingTheFlag) {
  const testing::CommandResult server = testing::RunCommand(
      absl::StrCat(TTT_SERVER_BINARY,
                   " --backend=cpu --port=0 --metrics-port=-1 --single-sequence-kernel=sometimes"));
  EXPECT_EQ(server.exit_code, 1) << server.output;
  EXPECT_NE(server.output.find("single_sequence_kernel: 'sometimes' is not auto, on or off"),
            std::string::npos)
      << server.output;
}

// So does a count out of its range.
TEST(ServerProcessTest, ACountOutOfRangeStopsItAtStartNamingTheFlag) {
  for (const auto& [flag, message] :
       {std::pair{"--prefill-tokens-per-step=0", "prefill_tokens_per_step: at least 1 (got 0)"},
        std::pair{"--max-join-wait-steps=-2", "max_join_wait_steps: at least -1 (got -2)"}}) {
    // Bounded in time: a server that accepted the flag would serve until stopped.
    const testing::CommandResult server = testing::RunCommand(absl::StrCat(
        "timeout 60 ", TTT_SERVER_BINARY, " --backend=cpu --port=0 --metrics-port=-1 ", flag));
    EXPECT_EQ(server.exit_code, 1) << server.output;
    EXPECT_NE(server.output.find(message), std::string::npos) << server.output;
  }
}

}  // namespace
}  // namespace ttt
