// A real ttt server on loopback for tests: scheduler, gRPC service, health and /metrics, with a
// client stub on a real channel.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>
#include <prometheus/exposer.h>

#include "server/api/ttt_service.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/scheduler.h"

namespace ttt::testing {

struct TestServerOptions {
  std::string model_dir;
  int64_t max_sequences = 64;
  SchedulerOptions scheduler;
  int32_t stream_interval = 1;
  absl::Duration max_token_hold = kMaxTokenHold;
};

class TestServer {
 public:
  explicit TestServer(const TestServerOptions& options);
  ~TestServer();

  v1::TttService::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  const Model& model() const { return *model_; }
  Scheduler& scheduler() { return *scheduler_; }
  // "127.0.0.1:PORT" of the gRPC server.
  const std::string& target() const { return target_; }
  // GET /metrics. The endpoint starts on first use: stopping civetweb takes two seconds, which
  // tests that never scrape should not pay.
  std::string ScrapeMetrics();

 private:
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Scheduler> scheduler_;
  TttService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int metrics_port_ = 0;
  std::string target_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::TttService::Stub> stub_;
};

// A port nothing listens on now (civetweb cannot bind port 0 itself).
int FreePort();

// The value of the sample `name` (with its labels, as printed) in Prometheus text, or -1.
double MetricValue(const std::string& text, const std::string& sample);

}  // namespace ttt::testing
