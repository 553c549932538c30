// The gRPC face of the server (proto/ttt/v1/ttt.proto): validates requests, tokenizes, hands
// generations to the scheduler and streams their tokens back as text pieces.
#pragma once

#include <atomic>
#include <memory>

#include "absl/time/time.h"
#include "server/metrics/metrics.h"
#include "server/model/model.h"
#include "server/scheduler/scheduler.h"
#include "ttt/v1/ttt.grpc.pb.h"

namespace ttt {

// How long a streamed token may wait for the others of its message (TttService).
inline constexpr absl::Duration kMaxTokenHold = absl::Milliseconds(5);

class TttService final : public v1::TttService::Service {
 public:
  // Until Ready is called (the model is loading) every call answers UNAVAILABLE. A streamed
  // message waits for `stream_interval` tokens (at least 1), except the first token and the end,
  // which go at once: fewer, larger messages cost the server and its clients less per token. No
  // token waits longer than `max_token_hold` for the others, so that where steps are slow (the
  // CPU engine's tens of milliseconds) each goes as it comes.
  explicit TttService(int32_t stream_interval = 1, absl::Duration max_token_hold = kMaxTokenHold);
  void Ready(std::shared_ptr<const Model> model, Scheduler* scheduler, Metrics* metrics);

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Complete(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        v1::CompleteResponse* response) override;
  grpc::Status CreateSession(grpc::ServerContext* context, const v1::CreateSessionRequest* request,
                             v1::Session* response) override;
  grpc::Status ForkSession(grpc::ServerContext* context, const v1::ForkSessionRequest* request,
                           v1::Session* response) override;
  grpc::Status GetSession(grpc::ServerContext* context, const v1::GetSessionRequest* request,
                          v1::Session* response) override;
  grpc::Status DeleteSession(grpc::ServerContext* context, const v1::DeleteSessionRequest* request,
                             v1::DeleteSessionResponse* response) override;
  grpc::Status ExportSession(grpc::ServerContext* context, const v1::ExportSessionRequest* request,
                             v1::ExportSessionResponse* response) override;
  grpc::Status ImportSession(grpc::ServerContext* context, const v1::ImportSessionRequest* request,
                             v1::Session* response) override;
  grpc::Status Tokenize(grpc::ServerContext* context, const v1::TokenizeRequest* request,
                        v1::TokenizeResponse* response) override;
  grpc::Status Detokenize(grpc::ServerContext* context, const v1::DetokenizeRequest* request,
                          v1::DetokenizeResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::ModelInfo* response) override;

 private:
  struct Backend {
    std::shared_ptr<const Model> model;
    Scheduler* scheduler;
    Metrics* metrics;
  };
  // The loaded model, or UNAVAILABLE while loading.
  absl::StatusOr<const Backend*> backend() const;
  // Runs a generation, calling `emit` for each batch of at least `tokens_per_batch` tokens, or
  // fewer once the oldest has waited `max_hold` (the first token and the end go at once);
  // returns its end.
  grpc::Status RunGeneration(grpc::ServerContext* context, const v1::GenerateRequest& request,
                             size_t tokens_per_batch, absl::Duration max_hold,
                             const std::function<bool(v1::GenerateResponse&)>& emit);

  const size_t stream_interval_;
  const absl::Duration max_token_hold_;

  std::unique_ptr<Backend> backend_storage_;
  std::atomic<const Backend*> backend_{nullptr};
};

}  // namespace ttt
