// The server's Prometheus metrics, named and shaped like vLLM's (prefix ttt_), plus what only a
// TTT server has: sessions and state bytes per tier, state slots, batch sizes, step durations.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace ttt {

enum class FinishReason;
struct GenerationTimes;
struct SchedulerStats;

// The parts of the scheduler thread's loop, for ttt_scheduler_seconds_total.
enum class SchedulerPhase {
  kIdle,         // Waiting for work.
  kSessionCalls, // Session create, fork, export, ...
  kPrepare,      // Cancellations, deadlines, admission: while the engine computes.
  kEngineWait,   // Waiting for the step in flight.
  kCollect,      // Applying a step's tokens: the GPU is idle from here...
  kBatch,        // ...through choosing the next step's rows...
  kLaunch,       // ...to the engine having queued it.
  kRelease,      // Freeing finished requests, handing results to the delivery thread.
};
inline constexpr int kSchedulerPhases = 8;

class Metrics {
 public:
  // `engine_tier` labels states in the engine's pool: "gpu" (CUDA backend) or "cpu".
  explicit Metrics(std::string engine_tier);

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // A request ended: a success (by finish reason) when `status` is OK, else an error by code.
  void RequestFinished(FinishReason reason, const absl::Status& status,
                       const GenerationTimes& times);
  // A request that never reached the scheduler (invalid, queue full, draining).
  void RequestRejected(const absl::Status& status);
  void PromptTokens(int64_t count);
  // A generated token; `since_previous` is the time since the request's previous token (or, for
  // the first, since its arrival).
  void TokenGenerated(bool first, absl::Duration since_previous);
  // One engine step: rows in the batch, prompt tokens in it, time taken (and, where the engine
  // tells, the device's time on it and whether it ran as a graph captured before it).
  void StepFinished(int64_t batch_rows, int64_t prefill_tokens, absl::Duration duration,
                    std::optional<absl::Duration> device_time,
                    std::optional<bool> replayed_graph = std::nullopt);
  void SessionResumedFromHost();
  void SchedulerTime(SchedulerPhase phase, absl::Duration duration);
  void SchedulerState(const SchedulerStats& stats, size_t state_bytes_per_sequence,
                      int64_t total_slots);

 private:
  std::string engine_tier_;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Histogram* time_to_first_token_;
  prometheus::Histogram* inter_token_latency_;
  prometheus::Histogram* e2e_latency_;
  prometheus::Histogram* queue_time_;
  prometheus::Histogram* batch_size_;
  prometheus::Family<prometheus::Histogram>* step_duration_;
  prometheus::Family<prometheus::Histogram>* step_device_time_;
  prometheus::Family<prometheus::Counter>* step_graph_launches_;
  prometheus::Counter* scheduler_seconds_[kSchedulerPhases];
  prometheus::Gauge* running_;
  prometheus::Gauge* waiting_;
  prometheus::Counter* prompt_tokens_;
  prometheus::Counter* generation_tokens_;
  prometheus::Family<prometheus::Counter>* success_;
  prometheus::Family<prometheus::Counter>* errors_;
  prometheus::Family<prometheus::Gauge>* sessions_;
  prometheus::Family<prometheus::Gauge>* state_bytes_;
  prometheus::Family<prometheus::Gauge>* state_slots_;
  prometheus::Counter* session_resumes_;
};

}  // namespace ttt
