#include "tests/server/test_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include <gtest/gtest.h>

#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "server/engine/engine_factory.h"

namespace ttt::testing {

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  socklen_t length = sizeof address;
  getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  close(fd);
  return ntohs(address.sin_port);
}

TestServer::TestServer(const TestServerOptions& options)
    : service_(options.stream_interval, options.max_token_hold) {
  auto model = LoadModel(options.model_dir);
  EXPECT_TRUE(model.ok()) << model.status();
  model_ = *model;
  metrics_ = std::make_unique<Metrics>("cpu");
  // TTT_TEST_BACKEND=cuda runs the same suite on the GPU (float32 weights, to compare exactly),
  // the engine prepared for the scheduler's prefill budget as ttt-server prepares it.
  const char* backend = std::getenv("TTT_TEST_BACKEND");
  auto engine = CreateEngine(
      model_, {.backend = backend != nullptr ? backend : "cpu",
               .precision = WeightPrecision::kFloat32,
               .max_sequences = options.max_sequences,
               .prefill_tokens_per_step = options.scheduler.prefill_tokens_per_step});
  EXPECT_TRUE(engine.ok()) << engine.status();
  scheduler_ = std::make_unique<Scheduler>(*std::move(engine), options.scheduler, metrics_.get());
  service_.Ready(model_, scheduler_.get(), metrics_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service_);
  server_ = builder.BuildAndStart();
  server_->GetHealthCheckService()->SetServingStatus(true);
  target_ = absl::StrCat("127.0.0.1:", port);
  channel_ = grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
  stub_ = v1::TttService::NewStub(channel_);
}

TestServer::~TestServer() {
  scheduler_->CancelAll();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  exposer_.reset();
  scheduler_.reset();
}

std::string TestServer::ScrapeMetrics() {
  if (exposer_ == nullptr) {
    metrics_port_ = FreePort();
    exposer_ = std::make_unique<prometheus::Exposer>(absl::StrCat("127.0.0.1:", metrics_port_));
    exposer_->RegisterCollectable(metrics_->registry());
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(metrics_port_);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    ADD_FAILURE() << "cannot connect to the metrics port";
    return "";
  }
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  EXPECT_EQ(write(fd, request.data(), request.size()), ssize_t(request.size()));
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof buffer)) > 0) response.append(buffer, n);
  close(fd);
  return response;
}

double MetricValue(const std::string& text, const std::string& sample) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > sample.size() && line.substr(0, sample.size()) == sample &&
        line[sample.size()] == ' ') {
      return std::stod(std::string(line.substr(sample.size() + 1)));
    }
  }
  return -1;
}

}  // namespace ttt::testing
