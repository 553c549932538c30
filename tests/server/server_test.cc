// The server through a real gRPC channel on loopback: generation, concurrency, sessions, errors,
// cancellation, deadlines, back-pressure and metrics.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <latch>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/engine/cpu_engine.h"
#include "tests/server/test_server.h"
#include "tests/test_support.h"

namespace ttt {
namespace {

using ::testing::HasSubstr;

struct Streamed {
  grpc::Status status;
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  int messages = 0;
};

Streamed Generate(v1::TttService::Stub& stub, const v1::GenerateRequest& request,
                  absl::Duration timeout = absl::Seconds(60)) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(&context, request);
  Streamed out;
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    ++out.messages;
    for (const v1::Token& token : response.tokens()) {
      out.ids.push_back(token.id());
      out.logprobs.push_back(token.logprob());
      out.text += token.text();
    }
    if (response.has_usage()) {
      out.finish = response.finish_reason();
      out.usage = response.usage();
    }
  }
  out.status = reader->Finish();
  return out;
}

v1::GenerateRequest GreedyRequest(const std::vector<int32_t>& prompt, int32_t max_new_tokens) {
  v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Add(prompt.begin(), prompt.end());
  request.mutable_sampling()->set_temperature(0);
  request.mutable_stopping()->set_max_new_tokens(max_new_tokens);
  request.mutable_stopping()->set_ignore_eos(true);
  return request;
}

// Greedy tokens from the engine alone, for comparison.
std::vector<int32_t> EngineGreedy(std::shared_ptr<const Model> model,
                                  const std::vector<int32_t>& prompt, int32_t count) {
  CpuEngine engine(std::move(model));
  SequenceChunk chunk{*engine.CreateSequence(), prompt};
  std::vector<int32_t> out;
  const std::vector<SamplingParams> greedy(1);
  std::vector<SampledToken> sampled;
  for (int32_t i = 0; i < count; ++i) {
    EXPECT_TRUE(engine.ForwardAndSample({&chunk, 1}, greedy, &sampled).ok());
    out.push_back(sampled[0].id);
    chunk.tokens = std::span(&out.back(), 1);
  }
  return out;
}

class ServerTest : public ::testing::Test {
 protected:
  void Start(testing::TestServerOptions options = {}) {
    if (options.model_dir.empty())
      options.model_dir = testing::TestDataPath("golden/tiny-linear-m");
    server_ = std::make_unique<testing::TestServer>(options);
    golden_ = testing::LoadGolden("tiny-linear-m");
  }
  std::shared_ptr<const Model> model() {
    return std::shared_ptr<const Model>(std::shared_ptr<const Model>{}, &server_->model());
  }
  std::unique_ptr<testing::TestServer> server_;
  testing::Golden golden_;
};

TEST_F(ServerTest, StreamedGreedyEqualsTheReference) {
  Start();
  for (int64_t b = 0; b < golden_.batch; ++b) {
    const Streamed out = Generate(server_->stub(), GreedyRequest(golden_.input_ids[b],
                                                                 golden_.greedy_steps));
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    EXPECT_EQ(out.ids, golden_.greedy_ids[b]);
    EXPECT_EQ(out.finish, v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(out.usage.prompt_tokens(), golden_.length);
    EXPECT_EQ(out.usage.generated_tokens(), golden_.greedy_steps);
    EXPECT_GT(out.usage.time_to_first_token_seconds(), 0);
    EXPECT_GE(out.usage.total_seconds(), out.usage.time_to_first_token_seconds());
  }
}

TEST_F(ServerTest, UnaryCompleteEqualsTheStream) {
  Start();
  grpc::ClientContext context;
  v1::CompleteResponse response;
  ASSERT_TRUE(server_->stub()
                  .Complete(&context, GreedyRequest(golden_.input_ids[1], golden_.greedy_steps),
                            &response)
                  .ok());
  std::vector<int32_t> ids;
  for (const v1::Token& token : response.tokens()) ids.push_back(token.id());
  EXPECT_EQ(ids, golden_.greedy_ids[1]);
  EXPECT_EQ(response.finish_reason(), v1::FINISH_REASON_LENGTH);
}

TEST_F(ServerTest, AStreamIntervalSendsTheSameTokensInFewerMessages) {
  // Without an interval this stream takes 40 to 270 messages on the tiny model, as often as the
  // handler wakes; with it, at most 8.
  constexpr int32_t kTokens = 400, kInterval = 64;
  // No token is held long enough to go alone, however slow the machine.
  Start({.model_dir = "",
         .max_sequences = 64,
         .scheduler = {},
         .stream_interval = kInterval,
         .max_token_hold = absl::Seconds(60)});
  const std::vector<int32_t>& prompt = golden_.input_ids[0];
  const Streamed out = Generate(server_->stub(), GreedyRequest(prompt, kTokens));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.ids, EngineGreedy(model(), prompt, kTokens));
  // The first token at once, the last with the end, and messages of kInterval or more between.
  EXPECT_LE(out.messages, 2 + (kTokens - 2) / kInterval);
}

TEST_F(ServerTest, SixtyFourConcurrentRequestsEachGetTheirOwnTokens) {
  Start();
  constexpr int kRequests = 64;
  std::vector<std::vector<int32_t>> prompts(kRequests);
  for (int r = 0; r < kRequests; ++r) {
    for (int i = 0; i < 5 + r % 23; ++i) prompts[r].push_back((r * 31 + i * 7) % 512);
  }
  std::vector<Streamed> results(kRequests);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRequests; ++r) {
    threads.emplace_back([&, r] {
      results[r] = Generate(server_->stub(), GreedyRequest(prompts[r], 12 + r % 9));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRequests; ++r) {
    ASSERT_TRUE(results[r].status.ok()) << r << ": " << results[r].status.error_message();
    EXPECT_EQ(results[r].ids, EngineGreedy(model(), prompts[r], 12 + r % 9)) << "request " << r;
  }
}

// Requests arriving together are admitted together: of 64 sent at once (as many as the server
// has slots), the slowest to get its first token got it before any had finished decoding its
// 1,000, by the server's own clock. A scheduler that admitted a request only as another ended
// would make the later ones wait a whole decode. The clients send once all are ready, and the
// decode is long (seconds, against first tokens within tens of ms): on a loaded machine threads
// start late, and with 200 tokens a request that got in first finished before the last arrived.
TEST_F(ServerTest, ABurstOfRequestsAllGetFirstTokensBeforeAnyFinishes) {
  Start();
  constexpr int kRequests = 64, kTokens = 1000;
  std::vector<Streamed> results(kRequests);
  std::vector<std::thread> threads;
  std::latch all_ready(kRequests);
  for (int r = 0; r < kRequests; ++r) {
    threads.emplace_back([&, r] {
      const v1::GenerateRequest request = GreedyRequest({1 + r % 7, 2, 3}, kTokens);
      all_ready.arrive_and_wait();
      results[r] = Generate(server_->stub(), request);
    });
  }
  for (std::thread& t : threads) t.join();
  double slowest_first_token = 0, shortest_decode = std::numeric_limits<double>::infinity();
  for (const Streamed& result : results) {
    ASSERT_TRUE(result.status.ok()) << result.status.error_message();
    ASSERT_EQ(result.usage.generated_tokens(), kTokens);
    const double first_token = result.usage.time_to_first_token_seconds();
    slowest_first_token = std::max(slowest_first_token, first_token);
    shortest_decode = std::min(shortest_decode, result.usage.total_seconds() - first_token);
  }
  EXPECT_LT(slowest_first_token, shortest_decode);
}

TEST_F(ServerTest, SessionContinuedInPiecesEqualsOneLongRequest) {
  Start();
  grpc::ClientContext create_context;
  v1::CreateSessionRequest create;
  create.set_session_id("chat-1");
  v1::Session session;
  ASSERT_TRUE(server_->stub().CreateSession(&create_context, create, &session).ok());
  EXPECT_EQ(session.id(), "chat-1");
  EXPECT_EQ(session.tokens_absorbed(), 0);

  const std::vector<int32_t> first = {1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11};
  const std::vector<int32_t> second = {12, 13, 14, 15, 16};
  v1::GenerateRequest one = GreedyRequest(first, 9);
  one.set_session_id("chat-1");
  const Streamed a = Generate(server_->stub(), one);
  ASSERT_TRUE(a.status.ok()) << a.status.error_message();
  v1::GenerateRequest two = GreedyRequest(second, 7);
  two.set_session_id("chat-1");
  const Streamed b = Generate(server_->stub(), two);
  ASSERT_TRUE(b.status.ok()) << b.status.error_message();
  EXPECT_EQ(b.usage.prompt_tokens(), int32_t(second.size()));  // Only the new tokens.

  // One request over everything the session saw.
  std::vector<int32_t> whole = first;
  whole.insert(whole.end(), a.ids.begin(), a.ids.end());
  whole.insert(whole.end(), second.begin(), second.end());
  const Streamed all = Generate(server_->stub(), GreedyRequest(whole, 7));
  ASSERT_TRUE(all.status.ok());
  EXPECT_EQ(b.ids, all.ids);
  for (size_t i = 0; i < b.logprobs.size(); ++i) EXPECT_NEAR(b.logprobs[i], all.logprobs[i], 1e-4);

  grpc::ClientContext get_context;
  v1::GetSessionRequest get;
  get.set_session_id("chat-1");
  ASSERT_TRUE(server_->stub().GetSession(&get_context, get, &session).ok());
  EXPECT_EQ(session.tokens_absorbed(), int64_t(whole.size() + b.ids.size()));
  EXPECT_EQ(session.tier(), v1::SESSION_TIER_ENGINE);
  EXPECT_FALSE(session.busy());
}

// A request that ends on a stop token ends while the next step has already taken that token on
// the engine: the session then holds exactly the request's tokens, stop token included.
TEST_F(ServerTest, SessionEndingOnAStopTokenHoldsExactlyItsTokens) {
  Start();
  const std::vector<int32_t> prompt = {1, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11};
  const Streamed free_run = Generate(server_->stub(), GreedyRequest(prompt, 12));
  ASSERT_TRUE(free_run.status.ok());
  // Stop at the first token not seen before it, from the fifth on.
  size_t stop_at = 4;
  while (stop_at < free_run.ids.size() &&
         std::count(free_run.ids.begin(), free_run.ids.begin() + stop_at,
                    free_run.ids[stop_at]) > 0) {
    ++stop_at;
  }
  ASSERT_LT(stop_at, free_run.ids.size());

  grpc::ClientContext create_context;
  v1::CreateSessionRequest create;
  create.set_session_id("stops");
  v1::Session session;
  ASSERT_TRUE(server_->stub().CreateSession(&create_context, create, &session).ok());
  v1::GenerateRequest stopping = GreedyRequest(prompt, 12);
  stopping.set_session_id("stops");
  stopping.mutable_stopping()->add_stop_token_ids(free_run.ids[stop_at]);
  const Streamed stopped = Generate(server_->stub(), stopping);
  ASSERT_TRUE(stopped.status.ok()) << stopped.status.error_message();
  EXPECT_EQ(stopped.finish, v1::FINISH_REASON_STOP);
  const std::vector<int32_t> expected_ids(free_run.ids.begin(),
                                          free_run.ids.begin() + stop_at + 1);
  EXPECT_EQ(stopped.ids, expected_ids);

  grpc::ClientContext get_context;
  v1::GetSessionRequest get;
  get.set_session_id("stops");
  ASSERT_TRUE(server_->stub().GetSession(&get_context, get, &session).ok());
  EXPECT_EQ(session.tokens_absorbed(), int64_t(prompt.size() + expected_ids.size()));
  EXPECT_FALSE(session.busy());

  // Continuing it equals one request over everything.
  const std::vector<int32_t> more = {12, 13, 14};
  v1::GenerateRequest next = GreedyRequest(more, 6);
  next.set_session_id("stops");
  const Streamed continued = Generate(server_->stub(), next);
  ASSERT_TRUE(continued.status.ok()) << continued.status.error_message();
  std::vector<int32_t> whole = prompt;
  whole.insert(whole.end(), expected_ids.begin(), expected_ids.end());
  whole.insert(whole.end(), more.begin(), more.end());
  EXPECT_EQ(continued.ids, Generate(server_->stub(), GreedyRequest(whole, 6)).ids);
}

TEST_F(ServerTest, ForkExportAndImportContinueLikeTheOriginal) {
  Start();
  auto call = [&](auto method, const auto& request, auto* response) {
    grpc::ClientContext context;
    return (server_->stub().*method)(&context, request, response);
  };
  v1::CreateSessionRequest create;
  create.set_session_id("base");
  v1::Session session;
  ASSERT_TRUE(call(&v1::TttService::Stub::CreateSession, create, &session).ok());
  v1::GenerateRequest prime =
      GreedyRequest({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, 6);
  prime.set_session_id("base");
  ASSERT_TRUE(Generate(server_->stub(), prime).status.ok());

  v1::ForkSessionRequest fork;
  fork.set_source_session_id("base");
  fork.set_session_id("fork");
  ASSERT_TRUE(call(&v1::TttService::Stub::ForkSession, fork, &session).ok());
  v1::ExportSessionRequest export_request;
  export_request.set_session_id("base");
  v1::ExportSessionResponse exported;
  ASSERT_TRUE(call(&v1::TttService::Stub::ExportSession, export_request, &exported).ok());
  EXPECT_EQ(exported.tokens_absorbed(), 25);
  v1::ImportSessionRequest import;
  import.set_state(exported.state());
  import.set_session_id("imported");
  ASSERT_TRUE(call(&v1::TttService::Stub::ImportSession, import, &session).ok());
  EXPECT_EQ(session.tokens_absorbed(), 25);

  std::vector<std::vector<int32_t>> continuations;
  for (const char* id : {"base", "fork", "imported"}) {
    v1::GenerateRequest next = GreedyRequest({33, 34, 35}, 10);
    next.set_session_id(id);
    const Streamed out = Generate(server_->stub(), next);
    ASSERT_TRUE(out.status.ok()) << id << ": " << out.status.error_message();
    continuations.push_back(out.ids);
  }
  EXPECT_EQ(continuations[1], continuations[0]);
  EXPECT_EQ(continuations[2], continuations[0]);

  // Another model refuses the state.
  testing::TestServer other({.model_dir = testing::TestDataPath("golden/tiny-mlp-m"),
                             .max_sequences = 4,
                             .scheduler = {}});
  grpc::ClientContext context;
  const grpc::Status refused = other.stub().ImportSession(&context, import, &session);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(refused.error_message(), HasSubstr("tiny-linear-m"));

  v1::DeleteSessionRequest remove;
  remove.set_session_id("fork");
  v1::DeleteSessionResponse removed;
  ASSERT_TRUE(call(&v1::TttService::Stub::DeleteSession, remove, &removed).ok());
  EXPECT_EQ(call(&v1::TttService::Stub::DeleteSession, remove, &removed).error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(call(&v1::TttService::Stub::CreateSession, create, &session).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
}

TEST_F(ServerTest, IdleSessionsAreEvictedToHostAndComeBack) {
  Start({.model_dir = "", .max_sequences = 2, .scheduler = {}});
  std::vector<std::vector<int32_t>> first_outputs;
  for (const char* id : {"a", "b", "c"}) {  // Three sessions, two slots.
    grpc::ClientContext context;
    v1::CreateSessionRequest create;
    create.set_session_id(id);
    v1::Session session;
    ASSERT_TRUE(server_->stub().CreateSession(&context, create, &session).ok()) << id;
    v1::GenerateRequest request = GreedyRequest({1, 5, 9, 13}, 5);
    request.set_session_id(id);
    const Streamed out = Generate(server_->stub(), request);
    ASSERT_TRUE(out.status.ok()) << id << ": " << out.status.error_message();
    first_outputs.push_back(out.ids);
  }
  grpc::ClientContext context;
  v1::GetSessionRequest get;
  get.set_session_id("a");
  v1::Session a;
  ASSERT_TRUE(server_->stub().GetSession(&context, get, &a).ok());
  EXPECT_EQ(a.tier(), v1::SESSION_TIER_HOST);
  EXPECT_EQ(a.tokens_absorbed(), 9);
  SchedulerStats stats = server_->scheduler().Stats();
  EXPECT_EQ(stats.sessions_engine, 2);
  EXPECT_EQ(stats.sessions_host, 1);
  v1::GenerateRequest more = GreedyRequest({2, 3}, 4);
  more.set_session_id("a");
  const Streamed resumed = Generate(server_->stub(), more);
  ASSERT_TRUE(resumed.status.ok()) << resumed.status.error_message();
  std::vector<int32_t> whole = {1, 5, 9, 13};
  whole.insert(whole.end(), first_outputs[0].begin(), first_outputs[0].end());
  whole.insert(whole.end(), {2, 3});
  EXPECT_EQ(resumed.ids, EngineGreedy(model(), whole, 4));
  EXPECT_EQ(testing::MetricValue(server_->ScrapeMetrics(), "ttt_session_resumes_total"), 1);
  stats = server_->scheduler().Stats();  // "a" came back and another session left for the host.
  EXPECT_EQ(stats.sessions_engine, 2);
  EXPECT_EQ(stats.sessions_host, 1);

  for (const char* id : {"a", "b", "c"}) {
    grpc::ClientContext delete_context;
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    v1::DeleteSessionResponse response;
    ASSERT_TRUE(server_->stub().DeleteSession(&delete_context, request, &response).ok()) << id;
  }
  // The counts are refreshed at the end of the scheduler's next step.
  for (int i = 0; i < 100 && server_->scheduler().Stats().sessions_engine > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  stats = server_->scheduler().Stats();
  EXPECT_EQ(stats.sessions_engine, 0);
  EXPECT_EQ(stats.sessions_host, 0);
  EXPECT_EQ(stats.slots_used, 0);
}

TEST_F(ServerTest, SecondRequestOnABusySessionIsAborted) {
  Start();
  grpc::ClientContext create_context;
  v1::CreateSessionRequest create;
  create.set_session_id("busy");
  v1::Session session;
  ASSERT_TRUE(server_->stub().CreateSession(&create_context, create, &session).ok());
  v1::GenerateRequest long_request = GreedyRequest({1, 2, 3}, 1'000'000);
  long_request.set_session_id("busy");
  grpc::ClientContext long_context;
  auto reader = server_->stub().Generate(&long_context, long_request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));  // It is running.
  v1::GenerateRequest second = GreedyRequest({4}, 3);
  second.set_session_id("busy");
  const Streamed refused = Generate(server_->stub(), second);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(refused.status.error_message(), HasSubstr("session_id"));
  long_context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(ServerTest, CancellationFreesTheSlot) {
  Start({.model_dir = "", .max_sequences = 1, .scheduler = {}});
  grpc::ClientContext context;
  auto reader = server_->stub().Generate(&context, GreedyRequest({1, 2, 3}, 1'000'000));
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  context.TryCancel();
  while (reader->Read(&response)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  // The only slot is free again: a new request runs to the end.
  const Streamed next = Generate(server_->stub(), GreedyRequest({4, 5}, 3), absl::Seconds(10));
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  for (int i = 0; i < 100 && server_->scheduler().Stats().slots_used > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->scheduler().Stats().slots_used, 0);
}

TEST_F(ServerTest, DeadlinesAreHonouredWhileGeneratingAndWhileQueued) {
  Start({.model_dir = "", .max_sequences = 1, .scheduler = {}});
  const Streamed running =
      Generate(server_->stub(), GreedyRequest({1, 2}, 1'000'000), absl::Milliseconds(300));
  EXPECT_EQ(running.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);

  grpc::ClientContext hog_context;
  auto hog = server_->stub().Generate(&hog_context, GreedyRequest({1, 2}, 1'000'000));
  v1::GenerateResponse response;
  ASSERT_TRUE(hog->Read(&response));
  const Streamed queued = Generate(server_->stub(), GreedyRequest({3}, 2), absl::Milliseconds(300));
  EXPECT_EQ(queued.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(queued.ids.empty());
  hog_context.TryCancel();
  while (hog->Read(&response)) {
  }
  hog->Finish();
}

TEST_F(ServerTest, FullQueueIsResourceExhausted) {
  Start({.model_dir = "", .max_sequences = 1, .scheduler = {.max_waiting = 1}});
  grpc::ClientContext hog_context;
  auto hog = server_->stub().Generate(&hog_context, GreedyRequest({1, 2}, 1'000'000));
  v1::GenerateResponse response;
  ASSERT_TRUE(hog->Read(&response));
  grpc::ClientContext waiting_context;
  auto waiting = server_->stub().Generate(&waiting_context, GreedyRequest({3}, 2));
  for (int i = 0; i < 200 && server_->scheduler().Stats().waiting == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const Streamed refused = Generate(server_->stub(), GreedyRequest({4}, 2));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  hog_context.TryCancel();
  while (hog->Read(&response)) {
  }
  hog->Finish();
  while (waiting->Read(&response)) {
  }
  EXPECT_TRUE(waiting->Finish().ok());
}

TEST_F(ServerTest, NoSlotAndNothingEvictableIsResourceExhausted) {
  Start({.model_dir = "", .max_sequences = 1, .scheduler = {}});
  grpc::ClientContext create_context;
  v1::CreateSessionRequest create;
  create.set_session_id("holder");
  v1::Session session;
  ASSERT_TRUE(server_->stub().CreateSession(&create_context, create, &session).ok());
  // The only slot belongs to a session that is busy generating: nothing can be evicted.
  v1::GenerateRequest busy = GreedyRequest({1, 2}, 1'000'000);
  busy.set_session_id("holder");
  grpc::ClientContext busy_context;
  auto reader = server_->stub().Generate(&busy_context, busy);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  grpc::ClientContext second_context;
  create.set_session_id("second");
  const grpc::Status refused = server_->stub().CreateSession(&second_context, create, &session);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(refused.error_message(), HasSubstr("no idle session to evict"));
  busy_context.TryCancel();
  while (reader->Read(&response)) {
  }
  reader->Finish();
}

TEST_F(ServerTest, ALongPromptDoesNotStallRunningStreams) {
  Start({.model_dir = "", .max_sequences = 8, .scheduler = {.prefill_tokens_per_step = 64}});
  // A stream is running; a 20,000-token prompt arrives; the stream keeps getting tokens while
  // the prompt is processed in chunks of 64.
  grpc::ClientContext stream_context;
  auto stream = server_->stub().Generate(&stream_context, GreedyRequest({1, 2, 3}, 1'000'000));
  v1::GenerateResponse response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<int32_t> long_prompt(20'000);
  for (size_t i = 0; i < long_prompt.size(); ++i) long_prompt[i] = 3 + i % 500;
  std::atomic<bool> long_done{false};
  Streamed long_result;
  std::thread long_request([&] {
    long_result = Generate(server_->stub(), GreedyRequest(long_prompt, 1));
    long_done = true;
  });
  int tokens_while_prefilling = 0;
  while (!long_done && stream->Read(&response)) tokens_while_prefilling += response.tokens_size();
  long_request.join();
  ASSERT_TRUE(long_result.status.ok()) << long_result.status.error_message();
  EXPECT_EQ(long_result.usage.prompt_tokens(), 20'000);
  // 20,000 tokens in chunks of 64 take over 300 steps; the stream got a token in each.
  EXPECT_GT(tokens_while_prefilling, 250);
  stream_context.TryCancel();
  while (stream->Read(&response)) {
  }
  stream->Finish();
}

// Streams that decode until they are cancelled, each read on a thread of its own (a stream left
// unread would soon hold the connection's flow-control window, and every other call with it).
// They start in groups as large as the streams already decoding (1, 1, 2, 4...): a scheduler
// holding arrivals to join together lets such a group in at once.
class DecodingStreams {
 public:
  DecodingStreams(v1::TttService::Stub& stub, int count) {
    for (int started = 0; started < count; started = static_cast<int>(streams_.size())) {
      const int group = std::min(std::max(started, 1), count - started);
      std::latch decoding(group);
      for (int s = 0; s < group; ++s) {
        Stream& stream = *streams_.emplace_back(std::make_unique<Stream>());
        stream.reader = stub.Generate(&stream.context, GreedyRequest({1, 2, 3}, 1'000'000));
        stream.thread = std::thread([&stream, &decoding] {
          v1::GenerateResponse response;
          bool first = true;
          while (stream.reader->Read(&response)) {
            stream.tokens += response.tokens_size();
            if (std::exchange(first, false)) decoding.count_down();
          }
          if (first) decoding.count_down();
          stream.reader->Finish();
        });
      }
      decoding.wait();  // Each stream of the group has a token: each decodes.
    }
  }
  ~DecodingStreams() {
    for (auto& stream : streams_) stream->context.TryCancel();
    for (auto& stream : streams_) stream->thread.join();
  }
  int64_t tokens(int s) const { return streams_[s]->tokens; }

 private:
  struct Stream {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
    std::atomic<int64_t> tokens = 0;
    std::thread thread;
  };
  std::vector<std::unique_ptr<Stream>> streams_;
};

// While sequences decode, arrivals are held to join together: a step that takes prompts costs
// much more than a decode step. With the wait bound out of reach, three requests arriving one by
// one behind four decoding streams wait; the fourth makes them as many as the streams, and all
// four join in one step with prompts.
TEST_F(ServerTest, ArrivalsWhileOthersDecodeJoinTogether) {
  Start({.model_dir = "", .max_sequences = 16, .scheduler = {.max_join_wait_steps = 1'000'000}});
  constexpr int kStreams = 4;
  DecodingStreams streams(server_->stub(), kStreams);
  auto steps_with_prompts = [&] {
    return testing::MetricValue(server_->ScrapeMetrics(),
                                "ttt_step_duration_seconds_count{phase=\"prefill\"}");
  };
  auto graph_launches_with_prompts = [&] {
    return testing::MetricValue(server_->ScrapeMetrics(),
                                "ttt_step_graph_launches_total{phase=\"prefill\"}");
  };
  const double before = steps_with_prompts(), graph_launches_before = graph_launches_with_prompts();

  std::vector<Streamed> results(kStreams);
  std::vector<std::thread> arrivals;
  auto arrive = [&](int r) {
    arrivals.emplace_back([&, r] {
      results[r] = Generate(server_->stub(), GreedyRequest({5, 6, 7, 8 + r}, 2));
    });
  };
  // Each arrival is seen waiting before the next comes (the scheduler's figures, updated each
  // step); none of them joins.
  for (int r = 0; r + 1 < kStreams; ++r) {
    arrive(r);
    for (int i = 0; i < 500 && server_->scheduler().Stats().waiting < r + 1; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_EQ(server_->scheduler().Stats().waiting, r + 1);
  }
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(server_->scheduler().Stats().waiting, kStreams - 1);
  arrive(kStreams - 1);
  for (std::thread& arrival : arrivals) arrival.join();
  for (int r = 0; r < kStreams; ++r) {
    ASSERT_TRUE(results[r].status.ok()) << results[r].status.error_message();
    EXPECT_EQ(results[r].ids, EngineGreedy(model(), {5, 6, 7, 8 + r}, 2)) << "request " << r;
  }
  EXPECT_EQ(steps_with_prompts() - before, 1);
  // On the GPU that step ran as a graph the engine captured at start for the scheduler's prefill
  // budget; the CPU engine captures none.
  const bool gpu = server_->scheduler().engine().backend().starts_with("cuda");
  EXPECT_EQ(graph_launches_with_prompts() - graph_launches_before, gpu ? 1 : 0);
}

// A lone arrival behind four decoding streams joins once it has waited its bound of steps (each
// of which gives the streams a token).
TEST_F(ServerTest, ALoneArrivalJoinsOnceItHasWaitedItsBound) {
  Start({.model_dir = "", .max_sequences = 16, .scheduler = {.max_join_wait_steps = 200}});
  DecodingStreams streams(server_->stub(), 4);
  const int64_t before = streams.tokens(0);
  const Streamed lone = Generate(server_->stub(), GreedyRequest({5, 6, 7}, 2));
  ASSERT_TRUE(lone.status.ok()) << lone.status.error_message();
  EXPECT_EQ(lone.ids, EngineGreedy(model(), {5, 6, 7}, 2));
  // 200 steps, less the few tokens that may still be on their way to the reader.
  EXPECT_GE(streams.tokens(0) - before, 150);
}

TEST_F(ServerTest, InvalidRequestsNameTheField) {
  Start();
  struct Case {
    std::function<void(v1::GenerateRequest&)> edit;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](v1::GenerateRequest& r) { r.clear_token_ids(); }, "prompt"},
      {[](v1::GenerateRequest& r) { r.mutable_token_ids()->add_ids(512); }, "token_ids.ids[3]"},
      {[](v1::GenerateRequest& r) { r.mutable_token_ids()->add_ids(-4); }, "token_ids.ids[3]"},
      {[](v1::GenerateRequest& r) { r.set_text("hello"); }, "text"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_temperature(-1); },
       "sampling.temperature"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_top_p(0); }, "sampling.top_p"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_top_k(-1); }, "sampling.top_k"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_min_p(2); }, "sampling.min_p"},
      {[](v1::GenerateRequest& r) { r.mutable_sampling()->set_repetition_penalty(0); },
       "sampling.repetition_penalty"},
      {[](v1::GenerateRequest& r) { r.mutable_stopping()->set_max_new_tokens(-1); },
       "stopping.max_new_tokens"},
      {[](v1::GenerateRequest& r) { r.mutable_stopping()->add_stop_token_ids(9999); },
       "stopping.stop_token_ids[0]"},
      // (A string, not the literal: GCC 12 warns falsely of overlapping copies on that.)
      {[](v1::GenerateRequest& r) { r.mutable_stopping()->add_stop(std::string(1, 'x')); },
       "stopping.stop"},
      {[](v1::GenerateRequest& r) { r.set_top_logprobs(21); }, "top_logprobs"},
      {[](v1::GenerateRequest& r) { r.set_session_id("no spaces"); }, "session_id"},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest request = GreedyRequest({1, 2, 3}, 2);
    c.edit(request);
    const Streamed out = Generate(server_->stub(), request);
    EXPECT_EQ(out.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_THAT(out.status.error_message(), HasSubstr(c.field));
  }
  v1::GenerateRequest unknown = GreedyRequest({1}, 2);
  unknown.set_session_id("nobody");
  EXPECT_EQ(Generate(server_->stub(), unknown).status.error_code(), grpc::StatusCode::NOT_FOUND);
  // The server is unharmed.
  EXPECT_TRUE(Generate(server_->stub(), GreedyRequest({1, 2, 3}, 2)).status.ok());
}

// A copy of tiny-linear-m that declares the byte tokenizer, so prompts and output are text.
std::string ByteTokenizerModel() {
  const std::string dir = testing::ScratchDir();
  const std::string source = testing::TestDataPath("golden/tiny-linear-m");
  std::filesystem::copy_file(source + "/model.safetensors", dir + "/model.safetensors");
  auto config = LoadModelConfig(source);
  EXPECT_TRUE(config.ok());
  config->byte_token_offset = 3;
  std::ofstream(dir + "/config.json") << config->ToJson();
  return dir;
}

// Splits UTF-8 text into characters.
std::vector<std::string> Characters(const std::string& text) {
  std::vector<std::string> out;
  for (size_t i = 0; i < text.size();) {
    const unsigned char lead = text[i];
    const size_t n = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    out.push_back(text.substr(i, n));
    i += n;
  }
  return out;
}

TEST_F(ServerTest, TextStreamsAsValidUtf8AndStopsAtStopStrings) {
  Start({.model_dir = ByteTokenizerModel(), .max_sequences = 8, .scheduler = {}});
  v1::GenerateRequest request;
  request.set_text("Once upon a time");
  request.mutable_sampling()->set_temperature(0);
  request.mutable_stopping()->set_max_new_tokens(60);
  request.mutable_stopping()->set_ignore_eos(true);
  const Streamed free_run = Generate(server_->stub(), request);
  ASSERT_TRUE(free_run.status.ok()) << free_run.status.error_message();
  EXPECT_EQ(free_run.usage.prompt_tokens(), 17);  // BOS + 16 bytes.
  std::string copy = free_run.text;
  EXPECT_EQ(TakeCompleteUtf8(&copy, /*final=*/true), free_run.text) << "not valid UTF-8";
  const std::vector<std::string> chars = Characters(free_run.text);
  ASSERT_GT(chars.size(), 12u);

  // Stop at a two-character string from the middle: the text ends just before its first match.
  const std::string stop = chars[8] + chars[9];
  request.mutable_stopping()->add_stop(stop);
  const Streamed stopped = Generate(server_->stub(), request);
  ASSERT_TRUE(stopped.status.ok()) << stopped.status.error_message();
  EXPECT_EQ(stopped.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(stopped.text, free_run.text.substr(0, free_run.text.find(stop)));
  EXPECT_LT(stopped.ids.size(), free_run.ids.size());

  // The unary call finds it too, though it need not wake for every token otherwise.
  grpc::ClientContext context;
  v1::CompleteResponse completed;
  ASSERT_TRUE(server_->stub().Complete(&context, request, &completed).ok());
  EXPECT_EQ(completed.text(), stopped.text);
  EXPECT_EQ(completed.finish_reason(), v1::FINISH_REASON_STOP);
}

TEST_F(ServerTest, TokenizeDetokenizeAndModelInfo) {
  Start({.model_dir = ByteTokenizerModel(), .max_sequences = 8, .scheduler = {}});
  grpc::ClientContext tokenize_context;
  v1::TokenizeRequest tokenize;
  tokenize.set_text("héllo");
  tokenize.set_add_bos(true);
  v1::TokenizeResponse ids;
  ASSERT_TRUE(server_->stub().Tokenize(&tokenize_context, tokenize, &ids).ok());
  EXPECT_THAT(ids.ids(), ::testing::ElementsAre(1, 3 + 'h', 3 + 0xC3, 3 + 0xA9, 3 + 'l', 3 + 'l',
                                                3 + 'o'));
  grpc::ClientContext detokenize_context;
  v1::DetokenizeRequest detokenize;
  detokenize.mutable_ids()->CopyFrom(ids.ids());
  v1::DetokenizeResponse text;
  ASSERT_TRUE(server_->stub().Detokenize(&detokenize_context, detokenize, &text).ok());
  EXPECT_EQ(text.text(), "héllo");
  grpc::ClientContext bad_context;
  detokenize.add_ids(4000);
  const grpc::Status bad = server_->stub().Detokenize(&bad_context, detokenize, &text);
  EXPECT_EQ(bad.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(bad.error_message(), HasSubstr("ids[7]"));

  grpc::ClientContext info_context;
  v1::ModelInfo info;
  ASSERT_TRUE(server_->stub().GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.tokenizer(), "byte");
  EXPECT_EQ(info.vocab_size(), 512);
  EXPECT_EQ(info.backend(), server_->scheduler().engine().backend());
  EXPECT_EQ(info.state_bytes_per_sequence(), int64_t(server_->scheduler().engine().state_bytes()));
  EXPECT_EQ(info.state_slots_total(), 8);
  EXPECT_EQ(info.state_slots_used(), 0);
  EXPECT_THAT(info.config_json(), HasSubstr("\"tokenizer_type\":\"byte\""));
}

TEST_F(ServerTest, TopLogprobsAreTheModelsDistribution) {
  Start();
  v1::GenerateRequest request = GreedyRequest(golden_.input_ids[0], 1);
  request.set_top_logprobs(5);
  grpc::ClientContext context;
  v1::CompleteResponse response;
  ASSERT_TRUE(server_->stub().Complete(&context, request, &response).ok());
  ASSERT_EQ(response.tokens_size(), 1);
  const v1::Token& token = response.tokens(0);
  ASSERT_EQ(token.top_logprobs_size(), 5);
  EXPECT_EQ(token.top_logprobs(0).id(), token.id());  // Greedy picks the most likely.
  EXPECT_NEAR(token.top_logprobs(0).logprob(), token.logprob(), 1e-5);
  for (int i = 1; i < 5; ++i) {
    EXPECT_LE(token.top_logprobs(i).logprob(), token.top_logprobs(i - 1).logprob());
  }
}

// Requests whose tokens are chosen on the host (top_logprobs) and on the engine share the batch:
// the scheduler switches between queueing steps behind one another and running them one at a
// time, and every request still gets its own greedy tokens.
TEST_F(ServerTest, HostAndEngineSamplingRequestsRunTogether) {
  Start();
  const std::vector<int32_t> long_prompt = {1, 10, 20, 30, 40, 50, 60, 70};
  const std::vector<int32_t> short_prompt = {1, 11, 12, 13};
  Streamed plain, with_top;
  std::thread first([&] { plain = Generate(server_->stub(), GreedyRequest(long_prompt, 200)); });
  absl::SleepFor(absl::Milliseconds(5));  // Let it get going, then join it halfway.
  v1::GenerateRequest top = GreedyRequest(short_prompt, 20);
  top.set_top_logprobs(2);
  with_top = Generate(server_->stub(), top);
  first.join();
  ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  ASSERT_TRUE(with_top.status.ok()) << with_top.status.error_message();
  EXPECT_EQ(plain.ids, EngineGreedy(model(), long_prompt, 200));
  EXPECT_EQ(with_top.ids, EngineGreedy(model(), short_prompt, 20));
}

TEST_F(ServerTest, MetricsCountExactlyWhatHappened) {
  Start();
  int64_t prompt_tokens = 0, generated = 0;
  for (int r = 0; r < 5; ++r) {
    const std::vector<int32_t> prompt(3 + r, 7);
    const Streamed out = Generate(server_->stub(), GreedyRequest(prompt, 4 + r));
    ASSERT_TRUE(out.status.ok());
    prompt_tokens += prompt.size();
    generated += out.ids.size();
  }
  v1::GenerateRequest bad = GreedyRequest({1}, 2);
  bad.mutable_sampling()->set_top_p(5);
  EXPECT_FALSE(Generate(server_->stub(), bad).status.ok());

  const std::string text = server_->ScrapeMetrics();
  using testing::MetricValue;
  EXPECT_EQ(MetricValue(text, "ttt_prompt_tokens_total"), prompt_tokens);
  EXPECT_EQ(MetricValue(text, "ttt_generation_tokens_total"), generated);
  EXPECT_EQ(MetricValue(text, "ttt_request_success_total{finish_reason=\"length\"}"), 5);
  EXPECT_EQ(MetricValue(text, "ttt_request_errors_total{code=\"INVALID_ARGUMENT\"}"), 1);
  EXPECT_EQ(MetricValue(text, "ttt_time_to_first_token_seconds_count"), 5);
  EXPECT_EQ(MetricValue(text, "ttt_inter_token_latency_seconds_count"), generated - 5);
  EXPECT_EQ(MetricValue(text, "ttt_e2e_request_latency_seconds_count"), 5);
  EXPECT_GT(MetricValue(text, "ttt_time_to_first_token_seconds_sum"), 0);
  EXPECT_EQ(MetricValue(text, "ttt_num_requests_running"), 0);
  EXPECT_EQ(MetricValue(text, "ttt_state_slots{state=\"used\"}"), 0);
  EXPECT_EQ(MetricValue(text, "ttt_state_slots{state=\"free\"}"), 64);
  EXPECT_GT(MetricValue(text, "ttt_batch_size_count"), 0);
}

}  // namespace
}  // namespace ttt
