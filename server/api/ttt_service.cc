#include "server/api/ttt_service.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {
namespace {

constexpr int32_t kMaxTopLogprobs = 20;
constexpr absl::Duration kPollInterval = absl::Milliseconds(20);

grpc::Status ToGrpc(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
    case FinishReason::kEos: return v1::FINISH_REASON_EOS;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled: return v1::FINISH_REASON_CANCELLED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void ToProto(const SessionInfo& info, v1::Session* session) {
  session->set_id(info.id);
  session->set_tokens_absorbed(info.tokens_absorbed);
  session->set_tier(info.tier == SessionTier::kEngine ? v1::SESSION_TIER_ENGINE
                                                      : v1::SESSION_TIER_HOST);
  const int64_t nanos = absl::ToUnixNanos(info.last_used);
  session->mutable_last_used()->set_seconds(nanos / 1'000'000'000);
  session->mutable_last_used()->set_nanos(static_cast<int32_t>(nanos % 1'000'000'000));
  session->set_busy(info.busy);
}

// Letters, digits, '-', '_', '.'; 1..128 characters.
absl::Status CheckSessionId(std::string_view field, const std::string& id, bool may_be_empty) {
  if (id.empty()) {
    if (may_be_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(AbslView(field), ": required"));
  }
  const bool valid = id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
                       return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' ||
                              c == '.';
                     });
  if (!valid) {
    return absl::InvalidArgumentError(absl::StrCat(
        AbslView(field), ": '", id, "' is not 1-128 letters, digits, '-', '_' or '.'"));
  }
  return absl::OkStatus();
}

absl::Status CheckTokenIds(std::string_view field,
                           const google::protobuf::RepeatedField<int32_t>& ids, int64_t vocab) {
  for (int i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      const std::string range = absl::StrCat("[0, ", vocab, ")");
      return absl::InvalidArgumentError(absl::StrCat(AbslView(field), "[", i, "]: id ", ids[i],
                                                     " is outside the vocabulary ", range));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<GenerationSpec> ParseGenerateRequest(const v1::GenerateRequest& request,
                                                    const Model& model, absl::Time deadline) {
  GenerationSpec spec;
  TTT_RETURN_IF_ERROR(CheckSessionId("session_id", request.session_id(), true));
  spec.session_id = request.session_id();
  const int64_t vocab = model.config.vocab_size;
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (model.tokenizer == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "text: model '", model.name, "' has no tokenizer; send token_ids"));
      }
      const bool add_bos = request.has_add_bos() ? request.add_bos() : spec.session_id.empty();
      if (add_bos) spec.prompt.push_back(static_cast<int32_t>(model.config.bos_token_id));
      TTT_ASSIGN_OR_RETURN(std::vector<int32_t> ids, model.tokenizer->Encode(request.text()));
      spec.prompt.insert(spec.prompt.end(), ids.begin(), ids.end());
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      TTT_RETURN_IF_ERROR(CheckTokenIds("token_ids.ids", request.token_ids().ids(), vocab));
      spec.prompt.assign(request.token_ids().ids().begin(), request.token_ids().ids().end());
      break;
    case v1::GenerateRequest::PROMPT_NOT_SET:
      break;
  }
  if (spec.prompt.empty()) {
    return absl::InvalidArgumentError("prompt: empty; give text or token_ids");
  }
  const v1::SamplingParams& s = request.sampling();
  spec.sampling.temperature = s.has_temperature() ? s.temperature() : 1.0f;
  spec.sampling.top_k = s.top_k();
  spec.sampling.top_p = s.has_top_p() ? s.top_p() : 1.0f;
  spec.sampling.min_p = s.min_p();
  spec.sampling.repetition_penalty = s.has_repetition_penalty() ? s.repetition_penalty() : 1.0f;
  spec.sampling.presence_penalty = s.presence_penalty();
  spec.sampling.frequency_penalty = s.frequency_penalty();
  spec.sampling.seed = s.has_seed() ? s.seed() : absl::Uniform<uint64_t>(absl::BitGen());
  if (absl::Status valid = ValidateSamplingParams(spec.sampling); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("sampling.", valid.message()));
  }
  const v1::StoppingCriteria& stop = request.stopping();
  if (stop.max_new_tokens() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("stopping.max_new_tokens = ", stop.max_new_tokens(), ": must be >= 0"));
  }
  spec.stop.max_new_tokens = stop.max_new_tokens();
  TTT_RETURN_IF_ERROR(CheckTokenIds("stopping.stop_token_ids", stop.stop_token_ids(), vocab));
  spec.stop.stop_token_ids.assign(stop.stop_token_ids().begin(), stop.stop_token_ids().end());
  spec.stop.ignore_eos = stop.ignore_eos();
  for (int i = 0; i < stop.stop_size(); ++i) {
    if (stop.stop(i).empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stopping.stop[", i, "]: empty"));
    }
    if (model.tokenizer == nullptr) {
      return absl::InvalidArgumentError("stopping.stop: stop strings need a tokenizer");
    }
  }
  if (request.top_logprobs() < 0 || request.top_logprobs() > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs = ", request.top_logprobs(),
                                                   ": must be in [0, ", kMaxTopLogprobs, "]"));
  }
  spec.top_logprobs = request.top_logprobs();
  spec.deadline = deadline;
  return spec;
}

// Proto strings must be valid UTF-8: a lone token's bytes may be part of a character.
std::string ValidUtf8(std::string bytes) { return TakeCompleteUtf8(&bytes, /*final=*/true); }

absl::Time DeadlineOf(const grpc::ServerContext& context) {
  const auto deadline = context.deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// Turns generated tokens into text pieces, holding back text that may be the start of a stop
// string and cutting the text at the first stop string.
class TextStream {
 public:
  TextStream(const Tokenizer* tokenizer, std::vector<std::string> stops)
      : tokenizer_(tokenizer), stops_(std::move(stops)) {
    if (tokenizer_ != nullptr) detokenizer_.emplace(*tokenizer_);
  }

  // The text to attach to this token.
  std::string Push(int32_t id) {
    if (!detokenizer_) return "";
    pending_ += detokenizer_->Push(id);
    return Release(/*final=*/false);
  }
  // What is left at the end.
  std::string Flush() {
    if (!detokenizer_ || stopped_) return "";
    pending_ += detokenizer_->Flush();
    return Release(/*final=*/true);
  }
  bool stopped() const { return stopped_; }
  std::string Text(int32_t id) const { return tokenizer_ ? tokenizer_->TokenBytes(id) : ""; }

 private:
  std::string Release(bool final) {
    if (stopped_) return "";
    size_t cut = std::string::npos;
    for (const std::string& stop : stops_) cut = std::min(cut, pending_.find(stop));
    if (cut != std::string::npos) {
      stopped_ = true;
      return pending_.substr(0, cut);
    }
    size_t hold = 0;  // Longest suffix of pending that starts a stop string.
    if (!final) {
      for (const std::string& stop : stops_) {
        for (size_t n = std::min(stop.size() - 1, pending_.size()); n > hold; --n) {
          if (pending_.compare(pending_.size() - n, n, stop, 0, n) == 0) {
            hold = n;
            break;
          }
        }
      }
    }
    std::string out = pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    return out;
  }

  const Tokenizer* tokenizer_;
  std::optional<StreamingDetokenizer> detokenizer_;
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace

TttService::TttService(int32_t stream_interval, absl::Duration max_token_hold)
    : stream_interval_(static_cast<size_t>(std::max(stream_interval, 1))),
      max_token_hold_(max_token_hold) {}

void TttService::Ready(std::shared_ptr<const Model> model, Scheduler* scheduler, Metrics* metrics) {
  backend_storage_ = std::make_unique<Backend>(Backend{std::move(model), scheduler, metrics});
  backend_.store(backend_storage_.get());
}

absl::StatusOr<const TttService::Backend*> TttService::backend() const {
  const Backend* backend = backend_.load();
  if (backend == nullptr) return absl::UnavailableError("the model is still loading");
  return backend;
}

grpc::Status TttService::RunGeneration(grpc::ServerContext* context,
                                       const v1::GenerateRequest& request, size_t tokens_per_batch,
                                       absl::Duration max_hold,
                                       const std::function<bool(v1::GenerateResponse&)>& emit) {
  absl::StatusOr<const Backend*> backend = this->backend();
  if (!backend.ok()) return ToGrpc(backend.status());
  const Model& model = *(*backend)->model;
  Metrics* metrics = (*backend)->metrics;
  const absl::Time deadline = DeadlineOf(*context);
  absl::StatusOr<GenerationSpec> spec = ParseGenerateRequest(request, model, deadline);
  absl::StatusOr<std::shared_ptr<GenerationHandle>> handle =
      spec.ok() ? (*backend)->scheduler->Submit(*std::move(spec)) : spec.status();
  if (!handle.ok()) {
    if (metrics != nullptr) metrics->RequestRejected(handle.status());
    return ToGrpc(handle.status());
  }
  std::vector<std::string> stops(request.stopping().stop().begin(),
                                 request.stopping().stop().end());
  TextStream text(model.tokenizer.get(), std::move(stops));
  bool client_gone = false;
  int32_t tokens_sent = 0;
  while (true) {
    GenerationUpdate update;
    if (!(*handle)->Next(kPollInterval, &update, tokens_sent == 0 ? 1 : tokens_per_batch,
                         max_hold)) {
      if (!client_gone && context->IsCancelled()) {
        client_gone = true;
        (*handle)->Cancel(FinishReason::kCancelled);
      }
      continue;
    }
    v1::GenerateResponse response;
    for (const GeneratedToken& token : update.tokens) {
      if (text.stopped()) break;
      v1::Token* out = response.add_tokens();
      ++tokens_sent;
      out->set_id(token.id);
      out->set_logprob(token.logprob);
      out->set_text(text.Push(token.id));
      for (const auto& [id, logprob] : token.top_logprobs) {
        v1::TopLogprob* top = out->add_top_logprobs();
        top->set_id(id);
        top->set_text(ValidUtf8(text.Text(id)));
        top->set_logprob(logprob);
      }
      if (text.stopped()) (*handle)->Cancel(FinishReason::kStop);
    }
    if (update.finished) {
      if (client_gone) return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
      if (!update.status.ok()) return ToGrpc(update.status);
      // Held-back text (an unfinished character, the start of a stop string that never
      // completed) rides on the last token; the end of a generation always brings one, except
      // when the server cancels it.
      const std::string rest = text.Flush();
      if (!rest.empty() && response.tokens_size() > 0) {
        response.mutable_tokens(response.tokens_size() - 1)->mutable_text()->append(rest);
      }
      // Stop strings are found here, after the scheduler may already have gone on (or ended for
      // another reason): what the client saw decides.
      response.set_finish_reason(text.stopped() ? v1::FINISH_REASON_STOP
                                                : ToProto(update.finish_reason));
      v1::Usage* usage = response.mutable_usage();
      usage->set_prompt_tokens(update.times.prompt_tokens);
      usage->set_generated_tokens(tokens_sent);
      usage->set_queue_seconds(absl::ToDoubleSeconds(update.times.queue));
      usage->set_time_to_first_token_seconds(
          absl::ToDoubleSeconds(update.times.time_to_first_token));
      usage->set_total_seconds(absl::ToDoubleSeconds(update.times.total));
      emit(response);
      return grpc::Status::OK;
    }
    if (response.tokens_size() > 0 && !client_gone && !emit(response)) {
      client_gone = true;
      (*handle)->Cancel(FinishReason::kCancelled);
    }
  }
}

grpc::Status TttService::Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                  grpc::ServerWriter<v1::GenerateResponse>* writer) {
  return RunGeneration(context, *request, stream_interval_, max_token_hold_,
                       [&](v1::GenerateResponse& response) { return writer->Write(response); });
}

grpc::Status TttService::Complete(grpc::ServerContext* context, const v1::GenerateRequest* request,
                                  v1::CompleteResponse* response) {
  // One response: the handler need not wake for every token, unless it looks for stop strings.
  const bool stops = !request->stopping().stop().empty();
  const size_t tokens_per_batch = stops ? stream_interval_ : std::numeric_limits<size_t>::max();
  const absl::Duration max_hold = stops ? max_token_hold_ : absl::InfiniteDuration();
  auto collect = [&](v1::GenerateResponse& part) {
    for (v1::Token& token : *part.mutable_tokens()) {
      response->mutable_text()->append(token.text());
      *response->add_tokens() = std::move(token);
    }
    if (part.has_usage()) {
      response->set_finish_reason(part.finish_reason());
      *response->mutable_usage() = part.usage();
    }
    return true;
  };
  return RunGeneration(context, *request, tokens_per_batch, max_hold, collect);
}

// ---- Sessions ---------------------------------------------------------------------------------

#define TTT_BACKEND_OR_RETURN(name)                             \
  absl::StatusOr<const Backend*> name##_or = this->backend();   \
  if (!name##_or.ok()) return ToGrpc(name##_or.status());        \
  const Backend& name = **name##_or

grpc::Status TttService::CreateSession(grpc::ServerContext*,
                                       const v1::CreateSessionRequest* request,
                                       v1::Session* response) {
  TTT_BACKEND_OR_RETURN(backend);
  if (absl::Status valid = CheckSessionId("session_id", request->session_id(), true); !valid.ok()) {
    return ToGrpc(valid);
  }
  absl::StatusOr<SessionInfo> info = backend.scheduler->CreateSession(request->session_id());
  if (!info.ok()) return ToGrpc(info.status());
  ToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status TttService::ForkSession(grpc::ServerContext*, const v1::ForkSessionRequest* request,
                                     v1::Session* response) {
  TTT_BACKEND_OR_RETURN(backend);
  for (absl::Status valid :
       {CheckSessionId("source_session_id", request->source_session_id(), false),
        CheckSessionId("session_id", request->session_id(), true)}) {
    if (!valid.ok()) return ToGrpc(valid);
  }
  absl::StatusOr<SessionInfo> info =
      backend.scheduler->ForkSession(request->source_session_id(), request->session_id());
  if (!info.ok()) return ToGrpc(info.status());
  ToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status TttService::GetSession(grpc::ServerContext*, const v1::GetSessionRequest* request,
                                    v1::Session* response) {
  TTT_BACKEND_OR_RETURN(backend);
  if (absl::Status valid = CheckSessionId("session_id", request->session_id(), false);
      !valid.ok()) {
    return ToGrpc(valid);
  }
  absl::StatusOr<SessionInfo> info = backend.scheduler->GetSession(request->session_id());
  if (!info.ok()) return ToGrpc(info.status());
  ToProto(*info, response);
  return grpc::Status::OK;
}

grpc::Status TttService::DeleteSession(grpc::ServerContext*,
                                       const v1::DeleteSessionRequest* request,
                                       v1::DeleteSessionResponse*) {
  TTT_BACKEND_OR_RETURN(backend);
  if (absl::Status valid = CheckSessionId("session_id", request->session_id(), false);
      !valid.ok()) {
    return ToGrpc(valid);
  }
  return ToGrpc(backend.scheduler->DeleteSession(request->session_id()));
}

grpc::Status TttService::ExportSession(grpc::ServerContext*,
                                       const v1::ExportSessionRequest* request,
                                       v1::ExportSessionResponse* response) {
  TTT_BACKEND_OR_RETURN(backend);
  if (absl::Status valid = CheckSessionId("session_id", request->session_id(), false);
      !valid.ok()) {
    return ToGrpc(valid);
  }
  int64_t tokens = 0;
  absl::StatusOr<std::string> state =
      backend.scheduler->ExportSession(request->session_id(), &tokens);
  if (!state.ok()) return ToGrpc(state.status());
  response->set_state(*std::move(state));
  response->set_tokens_absorbed(tokens);
  return grpc::Status::OK;
}

grpc::Status TttService::ImportSession(grpc::ServerContext*,
                                       const v1::ImportSessionRequest* request,
                                       v1::Session* response) {
  TTT_BACKEND_OR_RETURN(backend);
  if (absl::Status valid = CheckSessionId("session_id", request->session_id(), true); !valid.ok()) {
    return ToGrpc(valid);
  }
  absl::StatusOr<SessionInfo> info =
      backend.scheduler->ImportSession(request->state(), request->session_id());
  if (!info.ok()) return ToGrpc(info.status());
  ToProto(*info, response);
  return grpc::Status::OK;
}

// ---- Tokens and model -------------------------------------------------------------------------

grpc::Status TttService::Tokenize(grpc::ServerContext*, const v1::TokenizeRequest* request,
                                  v1::TokenizeResponse* response) {
  TTT_BACKEND_OR_RETURN(backend);
  const Model& model = *backend.model;
  if (model.tokenizer == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("text: model '", model.name, "' has no tokenizer"));
  }
  absl::StatusOr<std::vector<int32_t>> ids = model.tokenizer->Encode(request->text());
  if (!ids.ok()) return ToGrpc(ids.status());
  if (request->add_bos()) response->add_ids(static_cast<int32_t>(model.config.bos_token_id));
  response->mutable_ids()->Add(ids->begin(), ids->end());
  return grpc::Status::OK;
}

grpc::Status TttService::Detokenize(grpc::ServerContext*, const v1::DetokenizeRequest* request,
                                    v1::DetokenizeResponse* response) {
  TTT_BACKEND_OR_RETURN(backend);
  const Model& model = *backend.model;
  if (model.tokenizer == nullptr) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("ids: model '", model.name, "' has no tokenizer"));
  }
  if (absl::Status valid = CheckTokenIds("ids", request->ids(), model.config.vocab_size);
      !valid.ok()) {
    return ToGrpc(valid);
  }
  const std::vector<int32_t> ids(request->ids().begin(), request->ids().end());
  response->set_text(model.tokenizer->Decode(ids));
  return grpc::Status::OK;
}

grpc::Status TttService::GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                                      v1::ModelInfo* response) {
  TTT_BACKEND_OR_RETURN(backend);
  const Model& model = *backend.model;
  const Engine& engine = backend.scheduler->engine();
  const SchedulerStats stats = backend.scheduler->Stats();
  response->set_name(model.name);
  response->set_config_json(model.config.ToJson());
  response->set_tokenizer(model.tokenizer ? std::string(model.tokenizer->kind()) : "");
  response->set_vocab_size(model.config.vocab_size);
  response->set_bos_token_id(static_cast<int32_t>(model.config.bos_token_id));
  response->set_eos_token_id(static_cast<int32_t>(model.config.eos_token_id));
  response->set_backend(std::string(engine.backend()));
  response->set_state_bytes_per_sequence(static_cast<int64_t>(engine.state_bytes()));
  response->set_state_slots_total(engine.max_sequences());
  response->set_state_slots_used(stats.slots_used);
  response->set_sessions(stats.sessions_engine + stats.sessions_host);
  response->set_max_context_tokens(backend.scheduler->options().max_context_tokens);
  return grpc::Status::OK;
}

}  // namespace ttt
