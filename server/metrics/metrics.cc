#include "server/metrics/metrics.h"

#include <string>

#include "absl/status/status.h"
#include "server/scheduler/scheduler.h"

namespace ttt {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Histogram;

// vLLM's bucket boundaries for the same histograms.
const Histogram::BucketBoundaries kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08,
                                                  0.1,   0.25,  0.5,  0.75, 1.0,  2.5,  5.0,
                                                  7.5,   10.0,  20.0, 40.0, 80.0};
const Histogram::BucketBoundaries kInterTokenBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                                                        0.3,  0.4,   0.5,  0.75,  1.0, 2.5,  5.0,
                                                        7.5,  10.0,  20.0, 40.0,  80.0};
const Histogram::BucketBoundaries kRequestBuckets = {0.3,  0.5,  0.8,  1.0,  1.5,  2.0,  2.5,
                                                     5.0,  10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                                     60.0, 120.0, 240.0, 480.0, 960.0};
const Histogram::BucketBoundaries kBatchBuckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
const Histogram::BucketBoundaries kStepBuckets = {0.0005, 0.001, 0.002, 0.005, 0.01, 0.02,
                                                  0.05,   0.1,   0.2,   0.5,   1.0,  2.0};

std::string ReasonLabel(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength: return "length";
    case FinishReason::kEos: return "eos";
    case FinishReason::kStop: return "stop";
    case FinishReason::kCancelled: return "cancelled";
  }
  return "unknown";
}

std::string CodeLabel(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  for (char& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return name;
}

}  // namespace

Metrics::Metrics(std::string engine_tier)
    : engine_tier_(std::move(engine_tier)), registry_(std::make_shared<prometheus::Registry>()) {
  auto histogram = [&](const char* name, const char* help, const Histogram::BucketBoundaries& b) {
    return &BuildHistogram().Name(name).Help(help).Register(*registry_).Add({}, b);
  };
  time_to_first_token_ = histogram("ttt_time_to_first_token_seconds",
                                   "Seconds from a request's arrival to its first token.",
                                   kTtftBuckets);
  inter_token_latency_ = histogram("ttt_inter_token_latency_seconds",
                                   "Seconds between consecutive tokens of a request.",
                                   kInterTokenBuckets);
  e2e_latency_ = histogram("ttt_e2e_request_latency_seconds",
                           "Seconds from a request's arrival to its end.", kRequestBuckets);
  // A part of the time to the first token, so in its buckets: milliseconds matter here.
  queue_time_ = histogram("ttt_request_queue_time_seconds",
                          "Seconds a request waited before its first step.", kTtftBuckets);
  batch_size_ = histogram("ttt_batch_size", "Sequences in one engine step.", kBatchBuckets);
  step_duration_ = &BuildHistogram()
                        .Name("ttt_step_duration_seconds")
                        .Help("Seconds per engine step; phase=prefill when the step held prompt "
                              "tokens, else decode.")
                        .Register(*registry_);
  step_device_time_ = &BuildHistogram()
                           .Name("ttt_step_device_seconds")
                           .Help("Seconds the device spent on an engine step, from its first "
                                 "operation on the device to its last (GPU engines); phase as "
                                 "for ttt_step_duration_seconds.")
                           .Register(*registry_);
  step_graph_launches_ =
      &BuildCounter()
           .Name("ttt_step_graph_launches_total")
           .Help("Engine steps launched as one graph captured before them (GPU engines); phase as "
                 "for ttt_step_duration_seconds, whose other steps launched kernel by kernel.")
           .Register(*registry_);
  running_ = &BuildGauge().Name("ttt_num_requests_running").Help("Requests in the running batch.")
                  .Register(*registry_).Add({});
  waiting_ = &BuildGauge().Name("ttt_num_requests_waiting").Help("Requests waiting for a slot.")
                  .Register(*registry_).Add({});
  prompt_tokens_ = &BuildCounter().Name("ttt_prompt_tokens_total").Help("Prompt tokens processed.")
                        .Register(*registry_).Add({});
  generation_tokens_ = &BuildCounter().Name("ttt_generation_tokens_total")
                            .Help("Tokens generated.").Register(*registry_).Add({});
  success_ = &BuildCounter().Name("ttt_request_success_total")
                  .Help("Requests that ended normally, by finish reason.").Register(*registry_);
  errors_ = &BuildCounter().Name("ttt_request_errors_total")
                 .Help("Requests that ended with an error, by gRPC status code.")
                 .Register(*registry_);
  sessions_ = &BuildGauge().Name("ttt_sessions").Help("Sessions, by where their state lives.")
                   .Register(*registry_);
  state_bytes_ = &BuildGauge().Name("ttt_state_bytes")
                      .Help("Bytes of sequence states, by where they live.").Register(*registry_);
  state_slots_ = &BuildGauge().Name("ttt_state_slots")
                      .Help("Engine state slots, used and free (free is absent when unbounded).")
                      .Register(*registry_);
  session_resumes_ = &BuildCounter().Name("ttt_session_resumes_total")
                          .Help("Sessions brought back from host memory into the engine.")
                          .Register(*registry_).Add({});
  for (const char* phase : {"prefill", "decode"}) {
    step_duration_->Add({{"phase", phase}}, kStepBuckets);
    step_device_time_->Add({{"phase", phase}}, kStepBuckets);
    step_graph_launches_->Add({{"phase", phase}});
  }
  auto& scheduler_seconds =
      BuildCounter()
          .Name("ttt_scheduler_seconds_total")
          .Help("Seconds of the scheduler thread by part of its loop. The next step is queued "
                "while one computes: the GPU waits only when the loop takes longer than a step.")
          .Register(*registry_);
  static constexpr const char* kPhaseLabels[kSchedulerPhases] = {
      "idle", "session_calls", "prepare", "engine_wait", "collect", "batch", "launch", "release"};
  for (int p = 0; p < kSchedulerPhases; ++p) {
    scheduler_seconds_[p] = &scheduler_seconds.Add({{"phase", kPhaseLabels[p]}});
  }
  for (FinishReason r : {FinishReason::kLength, FinishReason::kEos, FinishReason::kStop,
                         FinishReason::kCancelled}) {
    success_->Add({{"finish_reason", ReasonLabel(r)}});
  }
}

void Metrics::RequestFinished(FinishReason reason, const absl::Status& status,
                              const GenerationTimes& times) {
  if (status.ok()) {
    success_->Add({{"finish_reason", ReasonLabel(reason)}}).Increment();
  } else {
    errors_->Add({{"code", CodeLabel(status.code())}}).Increment();
  }
  e2e_latency_->Observe(absl::ToDoubleSeconds(times.total));
  queue_time_->Observe(absl::ToDoubleSeconds(times.queue));
}

void Metrics::RequestRejected(const absl::Status& status) {
  errors_->Add({{"code", CodeLabel(status.code())}}).Increment();
}

void Metrics::PromptTokens(int64_t count) { prompt_tokens_->Increment(count); }

void Metrics::TokenGenerated(bool first, absl::Duration since_previous) {
  generation_tokens_->Increment();
  (first ? time_to_first_token_ : inter_token_latency_)
      ->Observe(absl::ToDoubleSeconds(since_previous));
}

void Metrics::StepFinished(int64_t batch_rows, int64_t prefill_tokens, absl::Duration duration,
                           std::optional<absl::Duration> device_time,
                           std::optional<bool> replayed_graph) {
  batch_size_->Observe(static_cast<double>(batch_rows));
  const char* phase = prefill_tokens > 0 ? "prefill" : "decode";
  step_duration_->Add({{"phase", phase}}, kStepBuckets).Observe(absl::ToDoubleSeconds(duration));
  if (device_time.has_value()) {
    step_device_time_->Add({{"phase", phase}}, kStepBuckets)
        .Observe(absl::ToDoubleSeconds(*device_time));
  }
  if (replayed_graph.value_or(false)) step_graph_launches_->Add({{"phase", phase}}).Increment();
}

void Metrics::SessionResumedFromHost() { session_resumes_->Increment(); }

void Metrics::SchedulerTime(SchedulerPhase phase, absl::Duration duration) {
  scheduler_seconds_[static_cast<int>(phase)]->Increment(absl::ToDoubleSeconds(duration));
}

void Metrics::SchedulerState(const SchedulerStats& stats, size_t state_bytes_per_sequence,
                             int64_t total_slots) {
  running_->Set(static_cast<double>(stats.running));
  waiting_->Set(static_cast<double>(stats.waiting));
  sessions_->Add({{"tier", engine_tier_}}).Set(static_cast<double>(stats.sessions_engine));
  sessions_->Add({{"tier", "host"}}).Set(static_cast<double>(stats.sessions_host));
  state_bytes_->Add({{"tier", engine_tier_}})
      .Set(static_cast<double>(stats.slots_used) * state_bytes_per_sequence);
  state_bytes_->Add({{"tier", "host"}}).Set(static_cast<double>(stats.host_session_bytes));
  state_slots_->Add({{"state", "used"}}).Set(static_cast<double>(stats.slots_used));
  if (total_slots > 0) {
    state_slots_->Add({{"state", "free"}}).Set(static_cast<double>(total_slots - stats.slots_used));
  }
}

}  // namespace ttt
