// A C++ client of the ttt.v1 API: one object per server, each call with the client's deadline and
// metadata.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/time/time.h"
#include "ttt/v1/ttt.grpc.pb.h"

namespace ttt::client {

struct ClientOptions {
  std::string target = "localhost:50051";
  // Per call; InfiniteDuration: none.
  absl::Duration timeout = absl::InfiniteDuration();
  // Sent with every call (for example authorization headers for a proxy).
  std::vector<std::pair<std::string, std::string>> metadata;
  int max_message_bytes = 256 << 20;
  // A TCP connection of its own: gRPC otherwise shares one connection among the channels of a
  // process that go to the same target.
  bool own_connection = false;
};

enum class ServingStatus { kUnknown, kServing, kNotServing };

// "INVALID_ARGUMENT" and so on: gRPC's name of a status code.
std::string StatusCodeName(grpc::StatusCode code);

class Client {
 public:
  explicit Client(ClientOptions options);

  // Streams a generation: `on_response` sees every message as it arrives; returning false from
  // it cancels the call.
  grpc::Status Generate(const v1::GenerateRequest& request,
                        const std::function<bool(const v1::GenerateResponse&)>& on_response);
  // Starts a streaming generation and returns at once, for drivers of many streams that should
  // not spend a thread on each: `on_response` sees every message, in order, on one of gRPC's
  // threads; then `on_done` gets the call's status, and nothing of the call runs after it.
  void GenerateAsync(const v1::GenerateRequest& request,
                     std::function<void(const v1::GenerateResponse&)> on_response,
                     std::function<void(const grpc::Status&)> on_done);
  grpc::Status Complete(const v1::GenerateRequest& request, v1::CompleteResponse* response);

  grpc::Status CreateSession(const std::string& id, v1::Session* session);
  grpc::Status ForkSession(const std::string& source, const std::string& id, v1::Session* session);
  grpc::Status GetSession(const std::string& id, v1::Session* session);
  grpc::Status DeleteSession(const std::string& id);
  grpc::Status ExportSession(const std::string& id, v1::ExportSessionResponse* response);
  grpc::Status ImportSession(const std::string& state, const std::string& id, v1::Session* session);

  grpc::Status Tokenize(const std::string& text, bool add_bos, std::vector<int32_t>* ids);
  grpc::Status Detokenize(const std::vector<int32_t>& ids, std::string* text);
  grpc::Status GetModelInfo(v1::ModelInfo* info);
  // grpc.health.v1 Check of the whole server.
  grpc::Status Health(ServingStatus* status);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  void Prepare(grpc::ClientContext* context) const;
  // A unary call with the client's deadline and metadata, once the request's strings are
  // checked to be UTF-8 (INVALID_ARGUMENT naming the field where one is not).
  template <typename Request, typename Response>
  grpc::Status Call(grpc::Status (v1::TttService::Stub::*method)(grpc::ClientContext*,
                                                                 const Request&, Response*),
                    const Request& request, Response* response);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TttService::Stub> stub_;
};

}  // namespace ttt::client
