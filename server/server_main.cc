// ttt-server: serves one TTT model over gRPC, with Prometheus metrics on their own HTTP port.
//
//   ttt-server --model DIR [--port 50051] [--metrics-port 9090] [--backend auto|cpu|cuda]
//
// SIGTERM or SIGINT drains: health turns NOT_SERVING, new work is refused with UNAVAILABLE,
// work in progress may finish for --drain-grace-seconds and is then cancelled; exit code 0.
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <prometheus/exposer.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "server/api/ttt_service.h"
#include "server/engine/engine_factory.h"
#include "server/metrics/metrics.h"
#include "server/scheduler/scheduler.h"
#include "server/tools/default_model.h"
#include "server/tools/flag_names.h"
#include "server/util/status_macros.h"

ABSL_FLAG(
    std::string, model, "",
    "Model directory (config.json, model.safetensors, tokenizer); default: the bundled model.");
ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on.");
ABSL_FLAG(int32_t, port, 50051, "gRPC port (0: any free port, printed at start).");
ABSL_FLAG(int32_t, metrics_port, 9090, "Port of the Prometheus /metrics endpoint; -1: none.");
ABSL_FLAG(std::string, backend, "auto", "auto (CUDA when a GPU is present), cpu or cuda.");
ABSL_FLAG(std::string, precision, "bf16", "CUDA weight precision: bf16 or f32.");
ABSL_FLAG(
    int64_t, max_sequences, 0,
    "State slots (sequences in the engine at once); 0: as many as the pool holds (CPU: 1024).");
ABSL_FLAG(double, state_pool_fraction, 0.5, "CUDA: share of free GPU memory for sequence states.");
ABSL_FLAG(int64_t, max_waiting, 1024, "Waiting requests beyond this get RESOURCE_EXHAUSTED.");
ABSL_FLAG(int64_t, prefill_tokens_per_step, 2048, "Prompt tokens processed per engine step.");
// These two defaults go together (bench/README.md, served v18, 256 streams on the GPU): with a
// message a token, requests spent ~100 ms outside the server, their tokens queued on the way
// out; with four, they spend under 1 ms, but arrive spread over more steps, half of which then
// took prompts; holding arrivals four steps gathers them again. On the CPU engine a step takes
// tens of milliseconds and one with prompts costs little more than their rows: nothing waits.
ABSL_FLAG(int64_t, max_join_wait_steps, -1,
          "While sequences decode, steps an arriving request may wait for others to join with it "
          "(0: none; -1: 4 on the CUDA engine, 0 on the CPU engine).");
ABSL_FLAG(std::string, single_sequence_kernel, "auto",
          "CUDA: decode a lone sequence with every layer in one kernel: auto (whichever is faster "
          "for the model, timed at start), on (wherever the model fits it) or off.");
ABSL_FLAG(int64_t, max_host_session_bytes, int64_t{8} << 30,
          "Host memory for sessions evicted from the engine.");
ABSL_FLAG(int64_t, max_context_tokens, 0, "Tokens per sequence at most; 0: no limit.");
ABSL_FLAG(int32_t, default_max_new_tokens, 256, "max_new_tokens when a request gives none.");
ABSL_FLAG(int32_t, stream_interval, 4,
          "Tokens a streamed message waits for (the first token and the end go at once, and no "
          "token waits more than 5 ms; 1: a message a token): more makes fewer, larger messages, "
          "which cost the server and its clients less per token.");
ABSL_FLAG(int32_t, max_message_bytes, 256 << 20, "Largest gRPC message accepted or sent.");
ABSL_FLAG(double, drain_grace_seconds, 30, "On SIGTERM, how long work in progress may finish.");

namespace ttt {
namespace {

constexpr char kServiceName[] = "ttt.v1.TttService";
// The CPU engine is bounded by memory alone; a server still needs a bound for admission.
constexpr int64_t kCpuDefaultSequences = 1024;
// gRPC threads kept waiting for calls from the start (see the server's thread options in Run).
constexpr int kMinIdleThreads = 8;

void Log(const std::string& line) { std::fprintf(stderr, "ttt-server: %s\n", line.c_str()); }

// Counts below their least meaningful value are refused at start, naming the flag.
absl::Status CheckCounts() {
  const struct {
    const char* flag;
    int64_t value, least;
  } counts[] = {
      {"max_sequences", absl::GetFlag(FLAGS_max_sequences), 0},
      {"max_waiting", absl::GetFlag(FLAGS_max_waiting), 0},
      {"prefill_tokens_per_step", absl::GetFlag(FLAGS_prefill_tokens_per_step), 1},
      {"max_join_wait_steps", absl::GetFlag(FLAGS_max_join_wait_steps), -1},
      {"max_host_session_bytes", absl::GetFlag(FLAGS_max_host_session_bytes), 0},
      {"max_context_tokens", absl::GetFlag(FLAGS_max_context_tokens), 0},
      {"default_max_new_tokens", absl::GetFlag(FLAGS_default_max_new_tokens), 1},
      {"stream_interval", absl::GetFlag(FLAGS_stream_interval), 1},
      {"max_message_bytes", absl::GetFlag(FLAGS_max_message_bytes), 1},
  };
  for (const auto& count : counts) {
    if (count.value < count.least) {
      return absl::InvalidArgumentError(
          absl::StrCat(count.flag, ": at least ", count.least, " (got ", count.value, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status Run() {
  // Signals are taken by a waiting thread, not a handler: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  TTT_RETURN_IF_ERROR(CheckCounts());
  std::string model_dir = absl::GetFlag(FLAGS_model);
  if (model_dir.empty()) model_dir = DefaultModelDir();
  TTT_ASSIGN_OR_RETURN(WeightPrecision precision,
                       ParseWeightPrecision(absl::GetFlag(FLAGS_precision)));
  TTT_ASSIGN_OR_RETURN(const CudaEngineOptions::SingleSequenceKernel single_sequence_kernel,
                       ParseSingleSequenceKernel(absl::GetFlag(FLAGS_single_sequence_kernel)));

  // Serve health (NOT_SERVING) and UNAVAILABLE answers while the model loads.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  TttService service(absl::GetFlag(FLAGS_stream_interval));
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  // The synchronous server runs each call on a thread of its own, taken from its idle threads
  // (gRPC's "pollers"). By default it keeps two idle and lets the others exit when their calls
  // end; then a wave of streams arriving together (a batch of requests that ended on one step,
  // their clients sending the next) waits for threads made one at a time: ~20 ms for 256
  // streams, longer than 25 decode steps. So threads stay, idle, up to as many as calls the
  // server can hold at once (--max-waiting plus --max-sequences, counted as 1,024 when 0 leaves
  // the slots to the pool's size), and a few wait from the start, making more in parallel.
  const int64_t calls_at_once =
      absl::GetFlag(FLAGS_max_waiting) +
      (absl::GetFlag(FLAGS_max_sequences) > 0 ? absl::GetFlag(FLAGS_max_sequences)
                                              : kCpuDefaultSequences);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MIN_POLLERS, kMinIdleThreads);
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
                              static_cast<int>(std::min<int64_t>(calls_at_once, INT32_MAX)));
  builder.SetMaxReceiveMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  builder.SetMaxSendMessageSize(absl::GetFlag(FLAGS_max_message_bytes));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", absl::GetFlag(FLAGS_host), ":",
                                               absl::GetFlag(FLAGS_port)));
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus(false);
  Log(absl::StrCat("listening on port ", port, "; loading ", model_dir));

  TTT_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, LoadModel(model_dir));
  int64_t max_sequences = absl::GetFlag(FLAGS_max_sequences);
  TTT_ASSIGN_OR_RETURN(
      std::unique_ptr<Engine> engine,
      CreateEngine(model, {.backend = absl::GetFlag(FLAGS_backend),
                           .precision = precision,
                           .max_sequences = max_sequences,
                           .state_pool_fraction = absl::GetFlag(FLAGS_state_pool_fraction),
                           .prefill_tokens_per_step = absl::GetFlag(FLAGS_prefill_tokens_per_step),
                           .single_sequence_kernel = single_sequence_kernel}));
  if (engine->max_sequences() == 0) {
    TTT_ASSIGN_OR_RETURN(engine, CreateEngine(model, {.backend = "cpu",
                                                      .max_sequences = kCpuDefaultSequences}));
  }
  const std::string backend(engine->backend());
  const bool gpu = backend.starts_with("cuda");
  const int64_t max_join_wait_steps = absl::GetFlag(FLAGS_max_join_wait_steps) >= 0
                                          ? absl::GetFlag(FLAGS_max_join_wait_steps)
                                          : (gpu ? 4 : 0);
  Metrics metrics(gpu ? "gpu" : "cpu");
  std::unique_ptr<prometheus::Exposer> exposer;
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    exposer = std::make_unique<prometheus::Exposer>(
        absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_metrics_port)));
    exposer->RegisterCollectable(metrics.registry());
  }
  Scheduler scheduler(std::move(engine),
                      {.max_waiting = absl::GetFlag(FLAGS_max_waiting),
                       .prefill_tokens_per_step = absl::GetFlag(FLAGS_prefill_tokens_per_step),
                       .max_join_wait_steps = max_join_wait_steps,
                       .max_host_session_bytes = absl::GetFlag(FLAGS_max_host_session_bytes),
                       .max_context_tokens = absl::GetFlag(FLAGS_max_context_tokens),
                       .default_max_new_tokens = absl::GetFlag(FLAGS_default_max_new_tokens)},
                      &metrics);
  service.Ready(model, &scheduler, &metrics);
  health->SetServingStatus(true);
  Log(absl::StrCat("serving model '", model->name, "' on port ", port, " (", backend, ", ",
                   scheduler.engine().max_sequences(), " state slots of ",
                   scheduler.engine().state_bytes(), " bytes)",
                   exposer ? absl::StrCat("; metrics on port ", absl::GetFlag(FLAGS_metrics_port))
                           : ""));
  if (const std::string path = scheduler.engine().single_sequence_decode(); !path.empty()) {
    Log(absl::StrCat("a lone sequence decodes through ", path));
  }
  if (const std::string prepared = scheduler.engine().preparation(); !prepared.empty()) {
    Log(absl::StrCat("the engine prepared ", prepared));
  }

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  Log(absl::StrCat("signal ", signal_number, ": draining"));
  health->SetServingStatus(false);
  scheduler.Drain();
  const absl::Time give_up =
      absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_drain_grace_seconds));
  while (!scheduler.Idle() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(20));
  if (!scheduler.Idle()) {
    Log("grace period over: cancelling what is left");
    scheduler.CancelAll();
  }
  // Work is drained by now; the deadline only bounds calls that never end (health watches).
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  Log("stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace ttt

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Serves a TTT model over gRPC.\n  ttt-server --model DIR [--port N]");
  ttt::ParseFlags(argc, argv);
  if (absl::Status status = ttt::Run(); !status.ok()) {
    std::fprintf(stderr, "ttt-server: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
