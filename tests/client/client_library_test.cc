// The C++ client library against a real server: the asynchronous stream sees what the blocking
// one sees, errors arrive as statuses, and many streams can share a client.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "client/ttt_client.h"
#include "tests/server/test_server.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& prompt, int64_t max_new_tokens) {
  v1::GenerateRequest request;
  for (int32_t id : prompt) request.mutable_token_ids()->add_ids(id);
  request.mutable_sampling()->set_temperature(0);
  request.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(max_new_tokens));
  request.mutable_stopping()->set_ignore_eos(true);
  return request;
}

// What one GenerateAsync call delivered.
struct AsyncResult {
  std::vector<int32_t> ids;
  v1::FinishReason finish_reason = v1::FINISH_REASON_UNSPECIFIED;
  grpc::Status status;
  std::atomic<int> done_calls{0};
  absl::Notification done;
};

void StartAsync(client::Client& client, const v1::GenerateRequest& request, AsyncResult* result) {
  client.GenerateAsync(
      request,
      [result](const v1::GenerateResponse& response) {
        for (const v1::Token& token : response.tokens()) result->ids.push_back(token.id());
        if (response.has_usage()) result->finish_reason = response.finish_reason();
      },
      [result](const grpc::Status& status) {
        result->status = status;
        if (result->done_calls.fetch_add(1) == 0) result->done.Notify();
      });
}

class ClientLibraryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<testing::TestServer>(
        testing::TestServerOptions{.model_dir = testing::TestDataPath("golden/tiny-linear-m"),
                                   .max_sequences = 40,
                                   .scheduler = {}});
    client::ClientOptions options;
    options.target = server_->target();
    client_ = std::make_unique<client::Client>(options);
  }
  std::unique_ptr<testing::TestServer> server_;
  std::unique_ptr<client::Client> client_;
};

TEST_F(ClientLibraryTest, AsyncStreamSeesWhatTheBlockingStreamSees) {
  const testing::Golden golden = testing::LoadGolden("tiny-linear-m");
  const v1::GenerateRequest request = GreedyRequest(golden.input_ids[0], golden.greedy_steps);
  std::vector<int32_t> blocking;
  ASSERT_TRUE(client_
                  ->Generate(request,
                             [&](const v1::GenerateResponse& response) {
                               for (const v1::Token& t : response.tokens())
                                 blocking.push_back(t.id());
                               return true;
                             })
                  .ok());
  AsyncResult async;
  StartAsync(*client_, request, &async);
  ASSERT_TRUE(async.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(async.status.ok()) << async.status.error_message();
  EXPECT_EQ(async.ids, golden.greedy_ids[0]);
  EXPECT_EQ(async.ids, blocking);
  EXPECT_EQ(async.finish_reason, v1::FINISH_REASON_LENGTH);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(async.done_calls, 1);
}

TEST_F(ClientLibraryTest, AsyncStreamErrorsArriveAsAStatusNamingTheField) {
  v1::GenerateRequest request = GreedyRequest({1, 2, 3}, 4);
  request.mutable_sampling()->set_top_p(7);
  AsyncResult async;
  StartAsync(*client_, request, &async);
  ASSERT_TRUE(async.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(async.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(async.status.error_message(), HasSubstr("sampling.top_p"));
  EXPECT_TRUE(async.ids.empty());
}

// proto3 strings must be UTF-8: the server's parsing refuses other bytes as INTERNAL with no
// message, so the client refuses them first, naming the field as the server names the fields it
// refuses, and sends nothing.
TEST_F(ClientLibraryTest, StringsThatAreNotUtf8AreRefusedNamingTheField) {
  std::vector<int32_t> ids;
  grpc::Status status = client_->Tokenize("ok\xFF", /*add_bos=*/false, &ids);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "text: not valid UTF-8 (byte 2)");

  v1::GenerateRequest request = GreedyRequest({1, 2, 3}, 4);
  request.mutable_stopping()->add_stop("fine");
  request.mutable_stopping()->add_stop("\xC0\xAF");  // An overlong '/'.
  status = client_->Generate(request, [](const v1::GenerateResponse&) { return true; });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "stopping.stop[1]: not valid UTF-8 (byte 0)");
  AsyncResult async;
  StartAsync(*client_, request, &async);
  ASSERT_TRUE(async.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(async.status.error_message(), "stopping.stop[1]: not valid UTF-8 (byte 0)");
  EXPECT_EQ(async.done_calls, 1);

  v1::Session session;
  status = client_->CreateSession("chat\xE6", &session);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message(), "session_id: not valid UTF-8 (byte 4)");

  // Text that is UTF-8 goes through, and so do a state's bytes (a bytes field): the server judges
  // them (this model has no tokenizer, so no stop strings).
  request.mutable_stopping()->set_stop(1, "\xC3\xA9");  // é
  status = client_->Generate(request, [](const v1::GenerateResponse&) { return true; });
  EXPECT_EQ(status.error_message(), "stopping.stop: stop strings need a tokenizer");
  status = client_->ImportSession(std::string("\xFF\xFE", 2), "imported", &session);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("state: saved state is corrupt"));
}

TEST_F(ClientLibraryTest, ManyAsyncStreamsOnOneClientEachGetTheirOwnTokens) {
  constexpr int kStreams = 32;
  std::vector<AsyncResult> results(kStreams);
  for (int s = 0; s < kStreams; ++s) {
    StartAsync(*client_, GreedyRequest({1, 4 + s, 9, 2 * s + 3}, 6 + s % 5), &results[s]);
  }
  for (int s = 0; s < kStreams; ++s) {
    ASSERT_TRUE(results[s].done.WaitForNotificationWithTimeout(absl::Seconds(60))) << s;
    EXPECT_TRUE(results[s].status.ok()) << s << ": " << results[s].status.error_message();
    EXPECT_EQ(results[s].ids.size(), static_cast<size_t>(6 + s % 5)) << s;
    // Each stream's tokens are its own: the same request again, alone, gives the same ids.
    if (s % 8 == 0) {
      AsyncResult alone;
      StartAsync(*client_, GreedyRequest({1, 4 + s, 9, 2 * s + 3}, 6 + s % 5), &alone);
      ASSERT_TRUE(alone.done.WaitForNotificationWithTimeout(absl::Seconds(30)));
      EXPECT_EQ(alone.ids, results[s].ids) << s;
    }
  }
}

}  // namespace
}  // namespace ttt
