// ttt-loadgen: load for a ttt server, measured from outside.
//
//   ttt-loadgen --server HOST:PORT --concurrency 64 --duration 30
//   ttt-loadgen --rate 20 --requests 500 --prompt-tokens uniform:16:256 --output-tokens fixed:128
//
// Closed loop (--concurrency N streams, each starting a new request when its last one ends) or
// open loop (--rate R requests/s, Poisson arrivals). Prompts are random token ids; a share of the
// requests (--session-share) continue their stream's session instead of starting fresh. Prints a
// progress line while it runs, then a table and one JSON object (also to --json-out).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/ttt_client.h"
#include "server/tools/flag_names.h"
#include "server/util/percentile.h"

ABSL_FLAG(std::string, server, "localhost:50051", "The server's gRPC address.");
ABSL_FLAG(int32_t, concurrency, 16, "Closed loop: this many concurrent streams.");
ABSL_FLAG(int32_t, connections, 1, "TCP connections the streams are spread over (round robin).");
ABSL_FLAG(double, rate, 0, "Open loop: requests per second (Poisson); overrides --concurrency.");
ABSL_FLAG(double, duration, 0, "Seconds to run (0: until --requests are done).");
ABSL_FLAG(int64_t, requests, 0, "Requests to send (0: until --duration is over).");
ABSL_FLAG(std::string, prompt_tokens, "fixed:64", "fixed:N or uniform:MIN:MAX.");
ABSL_FLAG(std::string, output_tokens, "fixed:64", "fixed:N or uniform:MIN:MAX.");
ABSL_FLAG(double, session_share, 0, "Share of requests that continue their stream's session.");
ABSL_FLAG(float, temperature, 1.0f, "Sampling temperature of every request.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of prompts and arrivals (each request's sampling seed too).");
ABSL_FLAG(std::string, json_out, "", "Also write the JSON summary here.");
ABSL_FLAG(bool, progress, true, "Print a progress line every second to stderr.");

namespace ttt::client {
namespace {

using Clock = std::chrono::steady_clock;

struct LengthDistribution {
  int64_t min = 0, max = 0;
  int64_t Draw(std::mt19937_64& rng) const {
    return std::uniform_int_distribution<int64_t>(min, max)(rng);
  }
  std::string Describe() const {
    return min == max ? absl::StrCat("fixed:", min) : absl::StrCat("uniform:", min, ":", max);
  }
};

bool ParseLengths(const std::string& text, LengthDistribution* out) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() == 2 && parts[0] == "fixed" && absl::SimpleAtoi(parts[1], &out->min)) {
    out->max = out->min;
    return out->min > 0;
  }
  return parts.size() == 3 && parts[0] == "uniform" && absl::SimpleAtoi(parts[1], &out->min) &&
         absl::SimpleAtoi(parts[2], &out->max) && out->min > 0 && out->max >= out->min;
}

struct Stats {
  std::mutex mutex;
  std::vector<double> ttft, itl;  // Seconds.
  // What the server counted (its usage report: from the request's arrival to its first token,
  // and to its end), and what the client counted beyond it: the request's way in, then the
  // first token's way out, or the end's (behind whatever tokens were still on their way).
  std::vector<double> server_ttft, ttft_outside_server, total_outside_server;
  std::map<std::string, int64_t> errors;
  int64_t completed = 0, generated_tokens = 0, prompt_tokens = 0, session_requests = 0;
  int64_t messages = 0;  // Responses that carried tokens.
};

class LoadGenerator {
 public:
  LoadGenerator(int64_t vocab, LengthDistribution prompts, LengthDistribution outputs)
      : vocab_(vocab), prompts_(prompts), outputs_(outputs) {}

  // Starts one request over `client` (`session` empty for a fresh sequence) and returns at once;
  // `ended` runs on one of gRPC's threads when it is over and counted.
  void Start(Client& client, std::mt19937_64& rng, const std::string& session,
             std::function<void()> ended) {
    v1::GenerateRequest request;
    const int64_t prompt_length = prompts_.Draw(rng);
    std::uniform_int_distribution<int32_t> token(3, static_cast<int32_t>(vocab_ - 1));
    for (int64_t i = 0; i < prompt_length; ++i) request.mutable_token_ids()->add_ids(token(rng));
    request.set_session_id(session);
    request.mutable_sampling()->set_temperature(absl::GetFlag(FLAGS_temperature));
    request.mutable_sampling()->set_seed(rng());
    request.mutable_stopping()->set_max_new_tokens(static_cast<int32_t>(outputs_.Draw(rng)));
    request.mutable_stopping()->set_ignore_eos(true);

    struct Timing {  // One request's, touched by one response at a time.
      Clock::time_point start, last;
      bool first = true;
      std::vector<double> ttft, itl;
      int64_t tokens = 0, messages = 0;
      v1::Usage usage;  // The server's account, on the last response.
      bool has_usage = false;
    };
    auto timing = std::make_shared<Timing>();
    timing->start = timing->last = Clock::now();
    client.GenerateAsync(
        request,
        [this, timing](const v1::GenerateResponse& r) {
          const Clock::time_point now = Clock::now();
          if (r.has_usage()) {
            timing->usage = r.usage();
            timing->has_usage = true;
          }
          const int n = r.tokens_size();
          if (n == 0) return;
          ++timing->messages;
          if (timing->first) {
            timing->ttft.push_back(std::chrono::duration<double>(now - timing->start).count());
            for (int i = 1; i < n; ++i) timing->itl.push_back(0);
            timing->first = false;
          } else {
            const double gap = std::chrono::duration<double>(now - timing->last).count() / n;
            for (int i = 0; i < n; ++i) timing->itl.push_back(gap);
          }
          timing->last = now;
          timing->tokens += n;
          received_.fetch_add(n, std::memory_order_relaxed);
        },
        [this, timing, prompt_length, continues = !session.empty(),
         ended = std::move(ended)](const grpc::Status& status) {
          const double total = std::chrono::duration<double>(Clock::now() - timing->start).count();
          {
            std::lock_guard<std::mutex> lock(stats_.mutex);
            stats_.generated_tokens += timing->tokens;
            stats_.messages += timing->messages;
            if (status.ok()) {
              ++stats_.completed;
              stats_.prompt_tokens += prompt_length;
              stats_.session_requests += continues;
              stats_.ttft.insert(stats_.ttft.end(), timing->ttft.begin(), timing->ttft.end());
              stats_.itl.insert(stats_.itl.end(), timing->itl.begin(), timing->itl.end());
              if (timing->has_usage && !timing->ttft.empty()) {
                const v1::Usage& usage = timing->usage;
                stats_.server_ttft.push_back(usage.time_to_first_token_seconds());
                stats_.ttft_outside_server.push_back(timing->ttft.front() -
                                                     usage.time_to_first_token_seconds());
                stats_.total_outside_server.push_back(total - usage.total_seconds());
              }
            } else {
              ++stats_.errors[StatusCodeName(status.error_code())];
            }
          }
          ended();
        });
  }

  Stats& stats() { return stats_; }
  // Tokens received so far, counted as they arrive (stats() counts a request's at its end).
  int64_t received() const { return received_.load(std::memory_order_relaxed); }

 private:
  const int64_t vocab_;
  const LengthDistribution prompts_, outputs_;
  Stats stats_;
  std::atomic<int64_t> received_{0};
};

int Run() {
  LengthDistribution prompts, outputs;
  if (!ParseLengths(absl::GetFlag(FLAGS_prompt_tokens), &prompts) ||
      !ParseLengths(absl::GetFlag(FLAGS_output_tokens), &outputs)) {
    std::fprintf(stderr,
                 "ttt-loadgen: --prompt-tokens / --output-tokens: fixed:N or uniform:MIN:MAX\n");
    return 2;
  }
  const double duration = absl::GetFlag(FLAGS_duration);
  const int64_t max_requests = absl::GetFlag(FLAGS_requests);
  if (duration <= 0 && max_requests <= 0) {
    std::fprintf(stderr, "ttt-loadgen: give --duration or --requests\n");
    return 2;
  }
  const int32_t connections = absl::GetFlag(FLAGS_connections);
  if (connections < 1) {
    std::fprintf(stderr, "ttt-loadgen: --connections must be at least 1\n");
    return 2;
  }
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_server);
  options.own_connection = connections > 1;
  std::vector<std::unique_ptr<Client>> clients;
  for (int32_t i = 0; i < connections; ++i) clients.push_back(std::make_unique<Client>(options));
  Client& client = *clients[0];
  v1::ModelInfo info;
  if (grpc::Status status = client.GetModelInfo(&info); !status.ok()) {
    std::fprintf(stderr, "ttt-loadgen: %s: %s\n", StatusCodeName(status.error_code()).c_str(),
                 status.error_message().c_str());
    return 1;
  }
  LoadGenerator generator(info.vocab_size(), prompts, outputs);
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      duration > 0 ? start + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(duration))
                   : Clock::time_point::max();
  std::atomic<int64_t> issued{0};
  auto take_ticket = [&] {
    if (Clock::now() >= end) return false;
    return max_requests <= 0 || issued.fetch_add(1) < max_requests;
  };
  const double session_share = absl::GetFlag(FLAGS_session_share);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);

  std::atomic<bool> done{false};
  std::thread progress([&] {
    while (!done) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      static Clock::time_point last_print = start;
      if (!absl::GetFlag(FLAGS_progress) || Clock::now() - last_print < std::chrono::seconds(1))
        continue;
      last_print = Clock::now();
      const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
      std::lock_guard<std::mutex> lock(generator.stats().mutex);
      int64_t errors = 0;
      for (const auto& [code, n] : generator.stats().errors) errors += n;
      std::fprintf(stderr, "[%6.1f s] %lld done, %lld errors, %.0f generated tokens/s\n", elapsed,
                   static_cast<long long>(generator.stats().completed),
                   static_cast<long long>(errors), generator.stats().generated_tokens / elapsed);
    }
  });

  // Requests (open loop) or streams (closed loop) still going; the run ends when none is left.
  // The streams run on gRPC's threads: a request's end starts its stream's next request.
  std::mutex running_mutex;
  std::condition_variable all_ended;
  int64_t running = 0;
  auto one_ended = [&] {
    std::lock_guard<std::mutex> lock(running_mutex);
    if (--running == 0) all_ended.notify_all();
  };
  struct Stream {
    Client* client;
    std::mt19937_64 rng;
    std::bernoulli_distribution continue_session;
    std::string session;  // When requests continue sessions.
  };
  std::vector<std::unique_ptr<Stream>> streams;
  // Closed loop: the span in which every stream had a request going, from the start until the
  // first stream runs out of requests. After it the streams end one by one, and with requests of
  // mixed lengths the last ones run nearly alone: the whole run's rate mixes that drain in, this
  // span's rate is the server's under full load.
  std::once_flag full_load_over;
  Clock::time_point full_load_end;
  int64_t full_load_tokens = 0;
  std::function<void(Stream&)> next_request = [&](Stream& stream) {
    if (!take_ticket()) {
      std::call_once(full_load_over, [&] {
        full_load_end = Clock::now();
        full_load_tokens = generator.received();
      });
      one_ended();
      return;
    }
    const bool continues = !stream.session.empty() && stream.continue_session(stream.rng);
    generator.Start(*stream.client, stream.rng, continues ? stream.session : "",
                    [&next_request, &stream] { next_request(stream); });
  };

  const double rate = absl::GetFlag(FLAGS_rate);
  if (rate > 0) {
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap(rate);
    Clock::time_point next = start;
    for (size_t i = 0; take_ticket(); ++i) {
      std::this_thread::sleep_until(next);
      std::mt19937_64 request_rng(rng());
      {
        std::lock_guard<std::mutex> lock(running_mutex);
        ++running;
      }
      generator.Start(*clients[i % clients.size()], request_rng, "", one_ended);
      next += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap(rng)));
    }
  } else {
    for (int32_t w = 0; w < absl::GetFlag(FLAGS_concurrency); ++w) {
      auto stream = std::make_unique<Stream>();
      stream->client = clients[w % clients.size()].get();
      stream->rng.seed(seed * 7919 + w);
      stream->continue_session = std::bernoulli_distribution(session_share);
      if (session_share > 0) {
        v1::Session created;
        if (stream->client->CreateSession("", &created).ok()) stream->session = created.id();
      }
      streams.push_back(std::move(stream));
    }
    running = static_cast<int64_t>(streams.size());
    for (auto& stream : streams) next_request(*stream);
  }
  {
    std::unique_lock<std::mutex> lock(running_mutex);
    all_ended.wait(lock, [&] { return running == 0; });
  }
  for (const auto& stream : streams) {
    if (!stream->session.empty()) stream->client->DeleteSession(stream->session);
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  done = true;
  progress.join();

  Stats& s = generator.stats();
  int64_t errors = 0;
  for (const auto& [code, n] : s.errors) errors += n;
  const double full_load_s =
      rate > 0 ? 0 : std::chrono::duration<double>(full_load_end - start).count();
  const double full_load_rate = full_load_s > 0 ? full_load_tokens / full_load_s : 0;
  auto percentiles_ms = [](const std::vector<double>& seconds) {
    return nlohmann::json{{"p50", 1e3 * Percentile(seconds, 0.5)},
                          {"p90", 1e3 * Percentile(seconds, 0.9)},
                          {"p99", 1e3 * Percentile(seconds, 0.99)}};
  };
  nlohmann::json summary = {
      {"server", absl::GetFlag(FLAGS_server)},
      {"model", info.name()},
      {"backend", info.backend()},
      {"mode", rate > 0 ? "rate" : "concurrency"},
      {"concurrency", rate > 0 ? 0 : absl::GetFlag(FLAGS_concurrency)},
      {"connections", connections},
      {"rate", rate},
      {"prompt_tokens", prompts.Describe()},
      {"output_tokens", outputs.Describe()},
      {"session_share", session_share},
      {"duration_s", elapsed},
      {"requests_completed", s.completed},
      {"requests_continuing_sessions", s.session_requests},
      {"requests_per_s", s.completed / elapsed},
      {"prompt_tokens_total", s.prompt_tokens},
      {"generated_tokens", s.generated_tokens},
      {"generated_tokens_per_s", s.generated_tokens / elapsed},
      {"full_load", rate > 0 ? nlohmann::json(nullptr)
                             : nlohmann::json{{"duration_s", full_load_s},
                                              {"generated_tokens_per_s", full_load_rate}}},
      {"ttft_ms", percentiles_ms(s.ttft)},
      {"itl_ms", percentiles_ms(s.itl)},
      {"tokens_per_message", s.messages > 0 ? double(s.generated_tokens) / s.messages : 0.0},
      // The time to the first token and the whole request, split into the server's count and
      // the rest (the request's way in, then the first token's or the end's way out).
      {"server_ttft_ms", percentiles_ms(s.server_ttft)},
      {"ttft_outside_server_ms", percentiles_ms(s.ttft_outside_server)},
      {"total_outside_server_ms", percentiles_ms(s.total_outside_server)},
      {"errors", s.errors},
  };
  std::printf("requests     %lld completed, %lld errors, %.2f /s\n",
              static_cast<long long>(s.completed), static_cast<long long>(errors),
              s.completed / elapsed);
  std::printf("tokens       %lld generated, %.1f /s\n", static_cast<long long>(s.generated_tokens),
              s.generated_tokens / elapsed);
  if (full_load_tokens > 0) {
    std::printf("full load    %.1f tokens/s in the first %.2f s, while every stream was busy\n",
                full_load_rate, full_load_s);
  }
  std::printf("ttft (ms)    p50 %.2f  p90 %.2f  p99 %.2f\n", 1e3 * Percentile(s.ttft, 0.5),
              1e3 * Percentile(s.ttft, 0.9), 1e3 * Percentile(s.ttft, 0.99));
  std::printf("itl (ms)     p50 %.3f  p90 %.3f  p99 %.3f\n", 1e3 * Percentile(s.itl, 0.5),
              1e3 * Percentile(s.itl, 0.9), 1e3 * Percentile(s.itl, 0.99));
  std::printf(
      "server (ms)  time to the first token p50 %.2f  p90 %.2f; outside the server: "
      "before the first token p50 %.2f  p90 %.2f, in all p50 %.2f  p90 %.2f\n",
      1e3 * Percentile(s.server_ttft, 0.5), 1e3 * Percentile(s.server_ttft, 0.9),
      1e3 * Percentile(s.ttft_outside_server, 0.5), 1e3 * Percentile(s.ttft_outside_server, 0.9),
      1e3 * Percentile(s.total_outside_server, 0.5), 1e3 * Percentile(s.total_outside_server, 0.9));
  for (const auto& [code, n] : s.errors)
    std::printf("error        %s: %lld\n", code.c_str(), static_cast<long long>(n));
  std::printf("%s\n", summary.dump().c_str());
  if (!absl::GetFlag(FLAGS_json_out).empty()) {
    std::ofstream(absl::GetFlag(FLAGS_json_out)) << summary.dump(2) << "\n";
  }
  return errors > 0 ? 1 : 0;
}

}  // namespace
}  // namespace ttt::client

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Load for a ttt server.\n"
      "  ttt-loadgen --server HOST:PORT (--concurrency N | --rate R)"
      " (--duration S | --requests N)");
  ttt::ParseFlags(argc, argv);
  return ttt::client::Run();
}
