// ttt-client: a command line for a ttt server.
//
//   ttt-client [--server HOST:PORT] [--timeout SECONDS] COMMAND [ARGS]
//     generate [--prompt TEXT | --prompt-ids 1,2,3] [--session ID] [sampling and stop flags]
//     session create [ID] | fork SOURCE [ID] | info ID | delete ID | export ID FILE |
//             import FILE [ID]
//     tokenize TEXT | detokenize IDS | info | health
//
// Errors print the gRPC status name and message. Exit codes: 0 success; 2 invalid arguments;
// 3 not found / already exists / failed precondition / aborted (a busy session); 4 resource
// exhausted / unavailable / deadline exceeded (worth retrying later); 5 cancelled; 1 anything else.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/ttt_client.h"
#include "server/tools/flag_names.h"

ABSL_FLAG(std::string, server, "localhost:50051", "The server's gRPC address.");
ABSL_FLAG(double, timeout, 0, "Deadline of each call in seconds; 0: none.");
ABSL_FLAG(std::vector<std::string>, metadata, {}, "key=value pairs sent with every call.");
// generate
ABSL_FLAG(std::string, prompt, "", "generate: the prompt as text.");
ABSL_FLAG(std::string, prompt_ids, "", "generate: the prompt as token ids, comma separated.");
ABSL_FLAG(std::string, session, "", "generate: continue this session.");
ABSL_FLAG(int32_t, max_new_tokens, 0, "generate: tokens at most (0: the server's default).");
ABSL_FLAG(std::optional<float>, temperature, std::nullopt, "generate: 0 greedy; default 1.");
ABSL_FLAG(int32_t, top_k, 0, "generate: sample among the k most likely (0: all).");
ABSL_FLAG(std::optional<float>, top_p, std::nullopt, "generate: nucleus threshold (default 1).");
ABSL_FLAG(float, min_p, 0, "generate: drop tokens below min_p × the top probability.");
ABSL_FLAG(std::optional<float>, repetition_penalty, std::nullopt,
          "generate: > 1 discourages repeats.");
ABSL_FLAG(float, presence_penalty, 0, "generate: subtracted once from seen output tokens.");
ABSL_FLAG(float, frequency_penalty, 0, "generate: subtracted per occurrence in the output.");
ABSL_FLAG(std::optional<uint64_t>, seed, std::nullopt, "generate: sampling seed.");
ABSL_FLAG(std::vector<std::string>, stop, {}, "generate: stop strings, comma separated.");
ABSL_FLAG(std::string, stop_token_ids, "", "generate: stop token ids, comma separated.");
ABSL_FLAG(bool, ignore_eos, false, "generate: go on after the end-of-sequence token.");
ABSL_FLAG(int32_t, top_logprobs, 0, "generate: print this many alternatives per token.");
ABSL_FLAG(std::optional<bool>, add_bos, std::nullopt, "generate: BOS before a text prompt.");
ABSL_FLAG(bool, print_ids, false, "generate: print token ids instead of text.");
ABSL_FLAG(bool, unary, false, "generate: one Complete call instead of a stream.");
ABSL_FLAG(bool, usage, true, "generate: print usage to stderr at the end.");

namespace ttt::client {
namespace {

int ExitCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return 0;
    case grpc::StatusCode::INVALID_ARGUMENT: case grpc::StatusCode::OUT_OF_RANGE: return 2;
    case grpc::StatusCode::NOT_FOUND: case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::FAILED_PRECONDITION: case grpc::StatusCode::ABORTED: return 3;
    case grpc::StatusCode::RESOURCE_EXHAUSTED: case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED: return 4;
    case grpc::StatusCode::CANCELLED: return 5;
    default: return 1;
  }
}

int Report(const grpc::Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "ttt-client: %s: %s\n", StatusCodeName(status.error_code()).c_str(),
                 status.error_message().c_str());
  }
  return ExitCode(status.error_code());
}

int Usage(const std::string& message) {
  std::fprintf(stderr, "ttt-client: %s (see --help)\n", message.c_str());
  return 2;
}

bool ParseIds(const std::string& text, std::vector<int32_t>* ids) {
  for (absl::string_view piece : absl::StrSplit(text, absl::ByAnyChar(", "), absl::SkipEmpty())) {
    int32_t id;
    if (!absl::SimpleAtoi(piece, &id)) return false;
    ids->push_back(id);
  }
  return true;
}

void PrintSession(const v1::Session& session) {
  std::printf("session %s: %lld tokens absorbed, tier %s%s\n", session.id().c_str(),
              static_cast<long long>(session.tokens_absorbed()),
              session.tier() == v1::SESSION_TIER_HOST ? "host" : "engine",
              session.busy() ? ", busy" : "");
}

int Generate(Client& client) {
  v1::GenerateRequest request;
  if (!absl::GetFlag(FLAGS_prompt).empty() && !absl::GetFlag(FLAGS_prompt_ids).empty()) {
    return Usage("--prompt and --prompt-ids: give one");
  }
  if (!absl::GetFlag(FLAGS_prompt_ids).empty()) {
    std::vector<int32_t> ids;
    if (!ParseIds(absl::GetFlag(FLAGS_prompt_ids), &ids)) return Usage("--prompt-ids: not ids");
    request.mutable_token_ids()->mutable_ids()->Add(ids.begin(), ids.end());
  } else {
    request.set_text(absl::GetFlag(FLAGS_prompt));
  }
  request.set_session_id(absl::GetFlag(FLAGS_session));
  v1::SamplingParams* sampling = request.mutable_sampling();
  if (auto v = absl::GetFlag(FLAGS_temperature)) sampling->set_temperature(*v);
  sampling->set_top_k(absl::GetFlag(FLAGS_top_k));
  if (auto v = absl::GetFlag(FLAGS_top_p)) sampling->set_top_p(*v);
  sampling->set_min_p(absl::GetFlag(FLAGS_min_p));
  if (auto v = absl::GetFlag(FLAGS_repetition_penalty)) sampling->set_repetition_penalty(*v);
  sampling->set_presence_penalty(absl::GetFlag(FLAGS_presence_penalty));
  sampling->set_frequency_penalty(absl::GetFlag(FLAGS_frequency_penalty));
  if (auto v = absl::GetFlag(FLAGS_seed)) sampling->set_seed(*v);
  v1::StoppingCriteria* stopping = request.mutable_stopping();
  stopping->set_max_new_tokens(absl::GetFlag(FLAGS_max_new_tokens));
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) stopping->add_stop(stop);
  std::vector<int32_t> stop_ids;
  if (!ParseIds(absl::GetFlag(FLAGS_stop_token_ids), &stop_ids)) {
    return Usage("--stop-token-ids: not ids");
  }
  stopping->mutable_stop_token_ids()->Add(stop_ids.begin(), stop_ids.end());
  stopping->set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  request.set_top_logprobs(absl::GetFlag(FLAGS_top_logprobs));
  if (auto v = absl::GetFlag(FLAGS_add_bos)) request.set_add_bos(*v);

  const bool print_ids = absl::GetFlag(FLAGS_print_ids);
  bool first = true;
  auto print_tokens = [&](const google::protobuf::RepeatedPtrField<v1::Token>& tokens) {
    for (const v1::Token& token : tokens) {
      if (print_ids) {
        std::printf("%s%d", first ? "" : " ", token.id());
      } else {
        std::fputs(token.text().c_str(), stdout);
      }
      first = false;
      for (const v1::TopLogprob& top : token.top_logprobs()) {
        std::fprintf(stderr, "  [%d %s %.4f]", top.id(), top.text().c_str(), top.logprob());
      }
      if (token.top_logprobs_size() > 0) std::fputc('\n', stderr);
    }
    std::fflush(stdout);
  };
  v1::Usage usage;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  grpc::Status status;
  if (absl::GetFlag(FLAGS_unary)) {
    v1::CompleteResponse response;
    status = client.Complete(request, &response);
    print_tokens(response.tokens());
    usage = response.usage();
    finish = response.finish_reason();
  } else {
    status = client.Generate(request, [&](const v1::GenerateResponse& response) {
      print_tokens(response.tokens());
      if (response.has_usage()) {
        usage = response.usage();
        finish = response.finish_reason();
      }
      return true;
    });
  }
  std::printf("\n");
  std::fflush(stdout);
  if (status.ok() && absl::GetFlag(FLAGS_usage)) {
    std::fprintf(stderr,
                 "[%s; %d prompt tokens, %d generated; queue %.3f s, first token %.3f s, total "
                 "%.3f s]\n",
                 v1::FinishReason_Name(finish).c_str(), usage.prompt_tokens(),
                 usage.generated_tokens(), usage.queue_seconds(),
                 usage.time_to_first_token_seconds(), usage.total_seconds());
  }
  return Report(status);
}

int Session(Client& client, const std::vector<std::string>& args) {
  if (args.empty()) return Usage("session: create, fork, info, delete, export or import");
  const std::string& verb = args[0];
  auto arg = [&](size_t i) { return i < args.size() ? args[i] : std::string(); };
  v1::Session session;
  grpc::Status status;
  if (verb == "create") {
    status = client.CreateSession(arg(1), &session);
  } else if (verb == "fork") {
    if (args.size() < 2) return Usage("session fork SOURCE [ID]");
    status = client.ForkSession(arg(1), arg(2), &session);
  } else if (verb == "info") {
    if (args.size() < 2) return Usage("session info ID");
    status = client.GetSession(arg(1), &session);
  } else if (verb == "delete") {
    if (args.size() < 2) return Usage("session delete ID");
    return Report(client.DeleteSession(arg(1)));
  } else if (verb == "export") {
    if (args.size() < 3) return Usage("session export ID FILE");
    v1::ExportSessionResponse exported;
    status = client.ExportSession(arg(1), &exported);
    if (status.ok()) {
      std::ofstream out(arg(2), std::ios::binary);
      out << exported.state();
      if (!out.flush()) return Usage(arg(2) + ": cannot write");
      std::printf("session %s: %lld tokens, %zu bytes written to %s\n", arg(1).c_str(),
                  static_cast<long long>(exported.tokens_absorbed()), exported.state().size(),
                  arg(2).c_str());
    }
    return Report(status);
  } else if (verb == "import") {
    if (args.size() < 2) return Usage("session import FILE [ID]");
    std::ifstream in(arg(1), std::ios::binary);
    if (!in) return Usage(arg(1) + ": cannot read");
    std::stringstream bytes;
    bytes << in.rdbuf();
    status = client.ImportSession(bytes.str(), arg(2), &session);
  } else {
    return Usage("session: unknown command '" + verb + "'");
  }
  if (status.ok()) PrintSession(session);
  return Report(status);
}

int Run(const std::vector<std::string>& positional) {
  if (positional.empty()) return Usage("a command is needed");
  ClientOptions options;
  options.target = absl::GetFlag(FLAGS_server);
  if (absl::GetFlag(FLAGS_timeout) > 0)
    options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout));
  for (const std::string& pair : absl::GetFlag(FLAGS_metadata)) {
    const size_t eq = pair.find('=');
    if (eq == std::string::npos) return Usage("--metadata: '" + pair + "' is not key=value");
    options.metadata.push_back({pair.substr(0, eq), pair.substr(eq + 1)});
  }
  Client client(options);
  const std::string& command = positional[0];
  const std::vector<std::string> args(positional.begin() + 1, positional.end());
  if (command == "generate") return Generate(client);
  if (command == "session") return Session(client, args);
  if (command == "tokenize") {
    if (args.empty()) return Usage("tokenize TEXT");
    std::vector<int32_t> ids;
    const grpc::Status status = client.Tokenize(args[0], false, &ids);
    if (status.ok()) std::printf("%s\n", absl::StrJoin(ids, " ").c_str());
    return Report(status);
  }
  if (command == "detokenize") {
    std::vector<int32_t> ids;
    if (args.empty() || !ParseIds(args[0], &ids)) return Usage("detokenize IDS");
    std::string text;
    const grpc::Status status = client.Detokenize(ids, &text);
    if (status.ok()) std::printf("%s\n", text.c_str());
    return Report(status);
  }
  if (command == "info") {
    v1::ModelInfo info;
    const grpc::Status status = client.GetModelInfo(&info);
    if (status.ok()) {
      std::printf("model %s (%s backend, tokenizer %s, vocabulary %lld)\n", info.name().c_str(),
                  info.backend().c_str(),
                  info.tokenizer().empty() ? "none" : info.tokenizer().c_str(),
                  static_cast<long long>(info.vocab_size()));
      std::printf("state: %lld bytes per sequence; slots %lld used of %lld; %lld sessions\n",
                  static_cast<long long>(info.state_bytes_per_sequence()),
                  static_cast<long long>(info.state_slots_used()),
                  static_cast<long long>(info.state_slots_total()),
                  static_cast<long long>(info.sessions()));
      std::printf("config: %s\n", info.config_json().c_str());
    }
    return Report(status);
  }
  if (command == "health") {
    ServingStatus serving;
    const grpc::Status status = client.Health(&serving);
    if (status.ok())
      std::printf("%s\n", serving == ServingStatus::kServing ? "SERVING" : "NOT_SERVING");
    if (status.ok() && serving != ServingStatus::kServing) return 4;
    return Report(status);
  }
  return Usage("unknown command '" + command + "'");
}

}  // namespace
}  // namespace ttt::client

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "A command line for a ttt server.\n"
      "  ttt-client [--server HOST:PORT] generate --prompt TEXT [--max-new-tokens N ...]\n"
      "  ttt-client session create|fork|info|delete|export|import ...\n"
      "  ttt-client tokenize TEXT | detokenize IDS | info | health");
  return ttt::client::Run(ttt::ParseFlags(argc, argv));
}
