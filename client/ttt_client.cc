#include "client/ttt_client.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>
#include <grpcpp/generic/generic_stub.h>

#include "server/util/utf8.h"

namespace ttt::client {
namespace {

// proto3's strings must be UTF-8. A request that holds other bytes is refused only by the
// server's parsing, as INTERNAL with an empty message; found here, it is INVALID_ARGUMENT naming
// the field, as the server names the fields it refuses ("stopping.stop[1]: …").
grpc::Status CheckUtf8(const google::protobuf::Message& message, const std::string& prefix = "") {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const FieldDescriptor* field : fields) {
    const bool text = field->type() == FieldDescriptor::TYPE_STRING;
    // Numbers and bytes need no check: a prompt's ten thousand ids are not walked one by one.
    if (!text && field->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE) continue;
    const int count = field->is_repeated() ? reflection->FieldSize(message, field) : 1;
    auto path = [&](int i) {
      std::string at = prefix + field->name();
      if (field->is_repeated()) at += '[' + std::to_string(i) + ']';
      return at;
    };
    for (int i = 0; i < count; ++i) {
      if (text) {
        std::string scratch;
        const std::string& value =
            field->is_repeated()
                ? reflection->GetRepeatedStringReference(message, field, i, &scratch)
                : reflection->GetStringReference(message, field, &scratch);
        if (const size_t at = FirstInvalidUtf8(value); at != std::string::npos) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              path(i) + ": not valid UTF-8 (byte " + std::to_string(at) + ")");
        }
      } else {
        const google::protobuf::Message& inner =
            field->is_repeated() ? reflection->GetRepeatedMessage(message, field, i)
                                 : reflection->GetMessage(message, field);
        if (grpc::Status status = CheckUtf8(inner, path(i) + "."); !status.ok()) return status;
      }
    }
  }
  return grpc::Status::OK;
}

}  // namespace

std::string StatusCodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  const int index = static_cast<int>(code);
  return index >= 0 && index < static_cast<int>(std::size(kNames)) ? kNames[index] : "UNKNOWN";
}

Client::Client(ClientOptions options) : options_(std::move(options)) {
  grpc::ChannelArguments arguments;
  arguments.SetMaxReceiveMessageSize(options_.max_message_bytes);
  arguments.SetMaxSendMessageSize(options_.max_message_bytes);
  if (options_.own_connection) arguments.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  channel_ = grpc::CreateCustomChannel(options_.target, grpc::InsecureChannelCredentials(),
                                       arguments);
  stub_ = v1::TttService::NewStub(channel_);
}

void Client::Prepare(grpc::ClientContext* context) const {
  if (options_.timeout != absl::InfiniteDuration()) {
    context->set_deadline(absl::ToChronoTime(absl::Now() + options_.timeout));
  }
  for (const auto& [key, value] : options_.metadata) context->AddMetadata(key, value);
}

template <typename Request, typename Response>
grpc::Status Client::Call(grpc::Status (v1::TttService::Stub::*method)(grpc::ClientContext*,
                                                                       const Request&, Response*),
                          const Request& request, Response* response) {
  if (grpc::Status invalid = CheckUtf8(request); !invalid.ok()) return invalid;
  grpc::ClientContext context;
  Prepare(&context);
  return (stub_.get()->*method)(&context, request, response);
}

grpc::Status Client::Generate(const v1::GenerateRequest& request,
                              const std::function<bool(const v1::GenerateResponse&)>& on_response) {
  if (grpc::Status invalid = CheckUtf8(request); !invalid.ok()) return invalid;
  grpc::ClientContext context;
  Prepare(&context);
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub_->Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (!on_response(response)) {
      context.TryCancel();
      while (reader->Read(&response)) {
      }
      break;
    }
  }
  return reader->Finish();
}

namespace {

// One GenerateAsync call; deletes itself when gRPC is done with it.
class GenerateStream final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateStream(const v1::GenerateRequest& request,
                 std::function<void(const v1::GenerateResponse&)> on_response,
                 std::function<void(const grpc::Status&)> on_done)
      : request_(request), on_response_(std::move(on_response)), on_done_(std::move(on_done)) {}

  grpc::ClientContext* context() { return &context_; }
  const v1::GenerateRequest* request() const { return &request_; }

  void Start() {
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // The end of the stream: OnDone follows.
    on_response_(response_);
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    on_done_(status);
    delete this;
  }

 private:
  grpc::ClientContext context_;
  const v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  std::function<void(const v1::GenerateResponse&)> on_response_;
  std::function<void(const grpc::Status&)> on_done_;
};

}  // namespace

void Client::GenerateAsync(const v1::GenerateRequest& request,
                           std::function<void(const v1::GenerateResponse&)> on_response,
                           std::function<void(const grpc::Status&)> on_done) {
  if (grpc::Status invalid = CheckUtf8(request); !invalid.ok()) {
    on_done(invalid);
    return;
  }
  auto* stream = new GenerateStream(request, std::move(on_response), std::move(on_done));
  Prepare(stream->context());
  stub_->async()->Generate(stream->context(), stream->request(), stream);
  stream->Start();
}

grpc::Status Client::Complete(const v1::GenerateRequest& request, v1::CompleteResponse* response) {
  return Call(&v1::TttService::Stub::Complete, request, response);
}

grpc::Status Client::CreateSession(const std::string& id, v1::Session* session) {
  v1::CreateSessionRequest request;
  request.set_session_id(id);
  return Call(&v1::TttService::Stub::CreateSession, request, session);
}

grpc::Status Client::ForkSession(const std::string& source, const std::string& id,
                                 v1::Session* session) {
  v1::ForkSessionRequest request;
  request.set_source_session_id(source);
  request.set_session_id(id);
  return Call(&v1::TttService::Stub::ForkSession, request, session);
}

grpc::Status Client::GetSession(const std::string& id, v1::Session* session) {
  v1::GetSessionRequest request;
  request.set_session_id(id);
  return Call(&v1::TttService::Stub::GetSession, request, session);
}

grpc::Status Client::DeleteSession(const std::string& id) {
  v1::DeleteSessionRequest request;
  request.set_session_id(id);
  v1::DeleteSessionResponse response;
  return Call(&v1::TttService::Stub::DeleteSession, request, &response);
}

grpc::Status Client::ExportSession(const std::string& id, v1::ExportSessionResponse* response) {
  v1::ExportSessionRequest request;
  request.set_session_id(id);
  return Call(&v1::TttService::Stub::ExportSession, request, response);
}

grpc::Status Client::ImportSession(const std::string& state, const std::string& id,
                                   v1::Session* session) {
  v1::ImportSessionRequest request;
  request.set_state(state);
  request.set_session_id(id);
  return Call(&v1::TttService::Stub::ImportSession, request, session);
}

grpc::Status Client::Tokenize(const std::string& text, bool add_bos, std::vector<int32_t>* ids) {
  v1::TokenizeRequest request;
  request.set_text(text);
  request.set_add_bos(add_bos);
  v1::TokenizeResponse response;
  grpc::Status status = Call(&v1::TttService::Stub::Tokenize, request, &response);
  ids->assign(response.ids().begin(), response.ids().end());
  return status;
}

grpc::Status Client::Detokenize(const std::vector<int32_t>& ids, std::string* text) {
  v1::DetokenizeRequest request;
  request.mutable_ids()->Add(ids.begin(), ids.end());
  v1::DetokenizeResponse response;
  grpc::Status status = Call(&v1::TttService::Stub::Detokenize, request, &response);
  *text = response.text();
  return status;
}

grpc::Status Client::GetModelInfo(v1::ModelInfo* info) {
  return Call(&v1::TttService::Stub::GetModelInfo, v1::GetModelInfoRequest(), info);
}

grpc::Status Client::Health(ServingStatus* serving) {
  // grpc.health.v1.Health/Check by hand: the request (service "") is empty; the response's field 1
  // is the status enum (1 SERVING, 2 NOT_SERVING).
  grpc::GenericStub stub(channel_);
  grpc::ClientContext context;
  Prepare(&context);
  grpc::Slice empty;
  grpc::ByteBuffer request(&empty, 1), response;
  grpc::CompletionQueue queue;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request, &queue);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, nullptr);
  void* tag;
  bool ok;
  queue.Next(&tag, &ok);
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  *serving = ServingStatus::kUnknown;
  if (!status.ok()) return status;
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  if (bytes.size() == 2 && bytes[0] == 0x08) {
    *serving = bytes[1] == 1 ? ServingStatus::kServing : ServingStatus::kNotServing;
  } else if (bytes.empty()) {
    *serving = ServingStatus::kNotServing;  // Status 0 (UNKNOWN) encodes as nothing.
  }
  return status;
}

}  // namespace ttt::client
