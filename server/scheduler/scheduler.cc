#include "server/scheduler/scheduler.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "server/metrics/metrics.h"
#include "server/util/absl_string_view.h"
#include "server/util/status_macros.h"

namespace ttt {

// ---- GenerationHandle -------------------------------------------------------------------------

bool GenerationHandle::Next(absl::Duration timeout, GenerationUpdate* update, size_t min_tokens,
                            absl::Duration max_hold) {
  absl::MutexLock lock(&mutex_);
  auto enough = [&] {
    mutex_.AssertHeld();
    return has_news_ && (pending_.finished || pending_.tokens.size() >= min_tokens);
  };
  auto held_long_enough = [&] {
    mutex_.AssertHeld();
    return !pending_.tokens.empty() && absl::Now() >= oldest_pending_ + max_hold;
  };
  const absl::Time deadline = absl::Now() + timeout;
  while (!enough() && !held_long_enough() && absl::Now() < deadline) {
    // Until a token is held, wake for the first one too: its hold starts then.
    const bool holding = !pending_.tokens.empty();
    auto wake = [&] {
      mutex_.AssertHeld();
      return enough() || (!holding && !pending_.tokens.empty());
    };
    mutex_.AwaitWithDeadline(absl::Condition(&wake),
                             holding ? std::min(deadline, oldest_pending_ + max_hold) : deadline);
  }
  if (!enough() && !held_long_enough()) return false;
  *update = std::move(pending_);
  pending_ = GenerationUpdate();
  has_news_ = false;
  return true;
}

void GenerationHandle::Cancel(FinishReason reason) {
  absl::MutexLock lock(&mutex_);
  if (cancel_.load(std::memory_order_relaxed)) return;
  cancel_reason_ = reason;
  cancel_.store(true, std::memory_order_release);
}

void GenerationHandle::Push(std::vector<GeneratedToken> tokens) {
  absl::MutexLock lock(&mutex_);
  if (pending_.tokens.empty()) oldest_pending_ = absl::Now();
  for (GeneratedToken& token : tokens) pending_.tokens.push_back(std::move(token));
  has_news_ = true;
}

void GenerationHandle::Finish(std::vector<GeneratedToken> tokens, FinishReason reason,
                              absl::Status status, const GenerationTimes& times) {
  absl::MutexLock lock(&mutex_);
  for (GeneratedToken& token : tokens) pending_.tokens.push_back(std::move(token));
  pending_.finished = true;
  pending_.finish_reason = reason;
  pending_.status = std::move(status);
  pending_.times = times;
  has_news_ = true;
}

bool GenerationHandle::cancel_requested(FinishReason* reason) {
  // Asked of every running request at every step: no lock unless there is a cancellation.
  if (!cancel_.load(std::memory_order_acquire)) return false;
  absl::MutexLock lock(&mutex_);
  *reason = cancel_reason_;
  return true;
}

namespace {

// The `n` most likely tokens of a row of logits and their log-probabilities, most likely first.
std::vector<std::pair<int32_t, float>> TopLogprobs(std::span<const float> logits, int32_t n) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float v : logits) sum += std::exp(double(v) - max);
  const float log_sum = static_cast<float>(std::log(sum)) + max;
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  n = std::min<int32_t>(n, static_cast<int32_t>(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(),
                    [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  std::vector<std::pair<int32_t, float>> top;
  for (int32_t k = 0; k < n; ++k) top.push_back({ids[k], logits[ids[k]] - log_sum});
  return top;
}

}  // namespace

// ---- Scheduler state --------------------------------------------------------------------------

struct Scheduler::Session {
  std::string id;
  SequenceSlot slot = -1;    // In the engine when >= 0,
  std::string saved_state;   // else evicted to host memory.
  int64_t length = 0;
  absl::Time last_used;
  bool busy = false;
};

struct Scheduler::Active {
  std::shared_ptr<GenerationHandle> handle;
  GenerationSpec spec;
  Session* session = nullptr;
  SequenceSlot slot = -1;
  size_t fed = 0;                 // Prompt tokens fed, or queued to be.
  std::vector<int32_t> output;    // Generated tokens collected.
  bool last_output_fed = true;    // Whether output.back() is fed, or queued to be.
  bool absorbing_final = false;   // Finished; one last chunk feeds the final token to a session.
  // The newest step that chooses this request's next token (0: none), and whether a step queued
  // behind that one takes the token on the engine.
  uint64_t chosen_in_step = 0;
  bool chosen_taken_ahead = false;
  int rows_in_flight = 0;  // In steps not collected yet: its slot and session stay until 0.
  std::optional<FinishReason> finish;
  // A session request's end waits until the session has absorbed its last token, so that a
  // client continuing the session right after the end never finds it busy.
  std::function<void()> deliver_finish;
  absl::Time arrival, first_step, first_token, last_token;
  uint64_t arrival_step = 0;  // The first step it could have joined.

  bool prefilling() const { return fed < spec.prompt.size(); }
};

enum class Scheduler::RowKind {
  kPrompt,      // A chunk of the prompt; the last one picks the first token.
  kDecode,      // The latest token, to pick the next.
  kFinalToken,  // A finished session request's last token, absorbed so the session holds it.
};

// One chunk of a step and the request it belongs to.
struct Scheduler::Row {
  Active* owner = nullptr;
  RowKind kind = RowKind::kDecode;
  bool samples = false;  // Whether the token chosen after the chunk is the request's.
};

// A step queued on the engine, until its tokens are collected.
struct Scheduler::StepInFlight {
  uint64_t id = 0;  // Steps count from 1.
  std::vector<SequenceChunk> batch;
  std::vector<Row> rows;  // One per chunk of `batch`.
  int64_t prefill_tokens = 0;
  // The step ran at once, on Forward, because a request samples from the logits on the host.
  bool host_sampling = false;
  std::vector<float> logits;
  absl::Status status;  // Of queueing (or running) the step.
  absl::Time start;
};

Scheduler::Scheduler(std::unique_ptr<Engine> engine, SchedulerOptions options, Metrics* metrics)
    : engine_(std::move(engine)), options_(options), metrics_(metrics) {
  thread_ = std::thread([this] { Loop(); });
}

Scheduler::~Scheduler() {
  CancelAll();
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

absl::StatusOr<std::shared_ptr<GenerationHandle>> Scheduler::Submit(GenerationSpec spec) {
  auto active = std::make_unique<Active>();
  active->handle = std::make_shared<GenerationHandle>();
  active->spec = std::move(spec);
  active->arrival = absl::Now();
  if (active->spec.stop.max_new_tokens <= 0) {
    active->spec.stop.max_new_tokens = options_.default_max_new_tokens;
  }
  if (options_.max_context_tokens > 0 && active->spec.session_id.empty() &&
      static_cast<int64_t>(active->spec.prompt.size()) + active->spec.stop.max_new_tokens >
          options_.max_context_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt: prompt tokens + max_new_tokens exceed max_context_tokens (",
                     options_.max_context_tokens, ")"));
  }
  std::shared_ptr<GenerationHandle> handle = active->handle;
  absl::MutexLock lock(&mutex_);
  if (draining_) return absl::UnavailableError("the server is draining");
  if (static_cast<int64_t>(incoming_.size()) + stats_.waiting >= options_.max_waiting) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the waiting queue is full (", options_.max_waiting, " requests)"));
  }
  incoming_.push_back(std::move(active));
  return handle;
}

absl::Status Scheduler::RunOnEngineThread(std::function<absl::Status()> task) {
  std::promise<absl::Status> done;
  std::future<absl::Status> result = done.get_future();
  {
    absl::MutexLock lock(&mutex_);
    if (stopping_) return absl::UnavailableError("the server is stopping");
    tasks_.push_back([&] { done.set_value(task()); });
  }
  return result.get();
}

void Scheduler::Drain() {
  absl::MutexLock lock(&mutex_);
  draining_ = true;
}

void Scheduler::CancelAll() {
  absl::MutexLock lock(&mutex_);
  cancel_all_ = true;
}

bool Scheduler::Idle() {
  absl::MutexLock lock(&mutex_);
  return incoming_.empty() && stats_.running == 0 && stats_.waiting == 0;
}

SchedulerStats Scheduler::Stats() {
  absl::MutexLock lock(&mutex_);
  return stats_;
}

// ---- The loop ---------------------------------------------------------------------------------

void Scheduler::ChargeTime(SchedulerPhase phase) {
  const absl::Time now = absl::Now();
  if (metrics_ != nullptr) metrics_->SchedulerTime(phase, now - phase_start_);
  phase_start_ = now;
}

void Scheduler::Loop() {
  pthread_setname_np(pthread_self(), "ttt-scheduler");  // As top -H and debuggers show it.
  phase_start_ = absl::Now();
  while (true) {
    std::deque<std::function<void()>> tasks;
    bool cancel_all = false;
    {
      absl::MutexLock lock(&mutex_);
      auto has_work = [this] {
        mutex_.AssertHeld();
        return stopping_ || !incoming_.empty() || !tasks_.empty() || cancel_all_ ||
               !waiting_.empty() || !running_.empty();
      };
      mutex_.Await(absl::Condition(&has_work));
      if (stopping_ && incoming_.empty() && tasks_.empty() && waiting_.empty() &&
          running_.empty()) {
        return;
      }
      tasks.swap(tasks_);
      while (!incoming_.empty()) {
        waiting_.push_back(std::move(incoming_.front()));
        waiting_.back()->arrival_step = next_step_id_;
        incoming_.pop_front();
      }
      std::swap(cancel_all, cancel_all_);
    }
    ChargeTime(SchedulerPhase::kIdle);
    for (auto& task : tasks) task();
    ChargeTime(SchedulerPhase::kSessionCalls);
    if (cancel_all) {
      for (auto& active : waiting_) active->handle->Cancel(FinishReason::kCancelled);
      for (auto& active : running_) active->handle->Cancel(FinishReason::kCancelled);
    }
    // Everything happens while the engine computes. The next step is queued behind the one in
    // flight, its decode rows taking that step's tokens on the engine, so the device goes from
    // step to step without waiting for the host; then the older step's tokens are collected.
    // Only when a step samples on the host is the step in flight collected first.
    Prepare();
    ChargeTime(SchedulerPhase::kPrepare);
    if (!in_flight_.empty() && !CanQueueBehindStepInFlight()) {
      CompleteStep();  // Charges kEngineWait and kCollect.
    }
    const bool launched = LaunchStep();
    ChargeTime(SchedulerPhase::kLaunch);
    if (in_flight_.size() > 1 || (!launched && !in_flight_.empty())) CompleteStep();
    ReleaseFinished();
    delivery_.Post(std::exchange(outbox_, {}));
    ChargeTime(SchedulerPhase::kRelease);
  }
}

void Scheduler::Finish(Active& active, FinishReason reason, absl::Status status,
                       std::vector<GeneratedToken> last_tokens) {
  const absl::Time now = absl::Now();
  GenerationTimes times;
  times.prompt_tokens = static_cast<int32_t>(active.spec.prompt.size());
  times.generated_tokens = static_cast<int32_t>(active.output.size());
  times.queue = (active.first_step == absl::Time() ? now : active.first_step) - active.arrival;
  times.time_to_first_token = active.first_token == absl::Time()
                                  ? absl::ZeroDuration()
                                  : active.first_token - active.arrival;
  times.total = now - active.arrival;
  if (metrics_ != nullptr) metrics_->RequestFinished(reason, status, times);
  active.finish = reason;
  const bool absorb_first = active.session != nullptr &&
                            (!active.last_output_fed || active.rows_in_flight > 0) && status.ok();
  auto deliver = [handle = active.handle, tokens = std::move(last_tokens), reason,
                  status = std::move(status), times]() mutable {
    handle->Finish(std::move(tokens), reason, std::move(status), times);
  };
  if (absorb_first) {
    active.deliver_finish = std::move(deliver);
  } else {
    outbox_.push_back(std::move(deliver));
  }
}

void Scheduler::ReleaseActive(Active& active) {
  if (active.deliver_finish) outbox_.push_back(std::exchange(active.deliver_finish, nullptr));
  if (active.session != nullptr) {
    active.session->busy = false;
    active.session->last_used = absl::Now();
    if (active.slot >= 0) {
      if (active.session->slot < 0) ++resident_sessions_;
      active.session->slot = active.slot;
      active.session->length = *engine_->SequenceLength(active.slot);
    }
  } else if (active.slot >= 0) {
    engine_->ReleaseSequence(active.slot).IgnoreError();
  }
  active.slot = -1;
}

absl::Status Scheduler::EvictOneIdleSession(const Session* keep) {
  Session* victim = nullptr;
  for (auto& [id, session] : sessions_) {
    if (session->busy || session->slot < 0 || session.get() == keep) continue;
    if (victim == nullptr || session->last_used < victim->last_used) victim = session.get();
  }
  if (victim == nullptr) {
    return absl::ResourceExhaustedError("no free state slot, and no idle session to evict");
  }
  if (host_session_bytes_ + static_cast<int64_t>(engine_->state_bytes()) >
      options_.max_host_session_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "no free state slot, and host memory for evicted sessions is full (",
        options_.max_host_session_bytes, " bytes)"));
  }
  TTT_ASSIGN_OR_RETURN(victim->saved_state, engine_->SaveSequence(victim->slot));
  TTT_RETURN_IF_ERROR(engine_->ReleaseSequence(victim->slot));
  victim->slot = -1;
  --resident_sessions_;
  host_session_bytes_ += victim->saved_state.size();
  return absl::OkStatus();
}

absl::StatusOr<SequenceSlot> Scheduler::CreateSlot(const Session* keep) {
  while (true) {
    absl::StatusOr<SequenceSlot> slot = engine_->CreateSequence();
    if (slot.ok() || slot.status().code() != absl::StatusCode::kResourceExhausted) return slot;
    TTT_RETURN_IF_ERROR(EvictOneIdleSession(keep));
  }
}

absl::StatusOr<SequenceSlot> Scheduler::ForkSlot(SequenceSlot source, const Session* keep) {
  while (true) {
    absl::StatusOr<SequenceSlot> slot = engine_->ForkSequence(source);
    if (slot.ok() || slot.status().code() != absl::StatusCode::kResourceExhausted) return slot;
    TTT_RETURN_IF_ERROR(EvictOneIdleSession(keep));
  }
}

absl::Status Scheduler::MakeResident(Session& session) {
  if (session.slot >= 0) return absl::OkStatus();
  while (true) {
    absl::StatusOr<SequenceSlot> slot = engine_->RestoreSequence(session.saved_state);
    if (slot.ok()) {
      if (metrics_ != nullptr) metrics_->SessionResumedFromHost();
      host_session_bytes_ -= session.saved_state.size();
      session.saved_state.clear();
      session.slot = *slot;
      ++resident_sessions_;
      return absl::OkStatus();
    }
    if (slot.status().code() != absl::StatusCode::kResourceExhausted) return slot.status();
    TTT_RETURN_IF_ERROR(EvictOneIdleSession(&session));
  }
}

absl::StatusOr<SequenceSlot> Scheduler::Admit(Active& active) {
  if (active.session == nullptr) return CreateSlot(nullptr);
  TTT_RETURN_IF_ERROR(MakeResident(*active.session));
  return active.session->slot;
}

void Scheduler::Prepare() {
  const absl::Time now = absl::Now();
  // Requests that arrived: bind sessions (one request per session at a time).
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Active& active = **it;
    if (active.session == nullptr && !active.spec.session_id.empty() && !active.finish) {
      absl::StatusOr<Session*> found = FindSession(active.spec.session_id, "session_id", true);
      if (!found.ok()) {
        Finish(active, FinishReason::kCancelled, found.status());
      } else {
        active.session = *found;
        active.session->busy = true;
        if (options_.max_context_tokens > 0 &&
            active.session->length + static_cast<int64_t>(active.spec.prompt.size()) +
                    active.spec.stop.max_new_tokens > options_.max_context_tokens) {
          active.session->busy = false;
          active.session = nullptr;
          Finish(active, FinishReason::kCancelled,
                 absl::InvalidArgumentError(absl::StrCat(
                     "prompt: the session's context would exceed max_context_tokens (",
                     options_.max_context_tokens, ")")));
        }
      }
    }
    if (active.finish) {
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }

  // Cancellations and deadlines, waiting and running alike. A running request may have a row in
  // the step in flight: CompleteStep drops that row's token.
  auto check_cancel = [&](Active& active) {
    FinishReason reason;
    if (active.handle->cancel_requested(&reason)) {
      Finish(active, reason, absl::OkStatus());
    } else if (now >= active.spec.deadline) {
      Finish(active, FinishReason::kCancelled,
             absl::DeadlineExceededError("the request's deadline passed"));
    }
  };
  for (auto& active : waiting_) check_cancel(*active);
  for (auto& active : running_) {
    if (!active->finish) check_cancel(*active);
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if ((*it)->finish) {
      if ((*it)->session != nullptr) (*it)->session->busy = false;
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }

  // Admission, first come first served.
  if (waiting_.empty() || !JoinNow()) return;
  while (!waiting_.empty()) {
    Active& active = *waiting_.front();
    absl::StatusOr<SequenceSlot> slot = Admit(active);
    if (!slot.ok()) {
      if (slot.status().code() == absl::StatusCode::kResourceExhausted && !running_.empty()) {
        break;  // Wait for a running request to end.
      }
      Finish(active, FinishReason::kCancelled, slot.status());
      if (active.session != nullptr) active.session->busy = false;
      waiting_.pop_front();
      continue;
    }
    active.slot = *slot;
    active.first_step = now;
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

bool Scheduler::JoinNow() const {
  int64_t decoding = 0;
  bool takes_prompts = false;
  for (const auto& active : running_) {
    if (active->finish) continue;
    if (active->prefilling()) {
      takes_prompts = true;
    } else {
      ++decoding;
    }
  }
  const uint64_t waited = next_step_id_ - waiting_.front()->arrival_step;
  return decoding == 0 || takes_prompts || static_cast<int64_t>(waiting_.size()) >= decoding ||
         waited >= static_cast<uint64_t>(options_.max_join_wait_steps);
}

bool Scheduler::SamplesOnHost(const GenerationSpec& spec) {
  // Penalties read the request's history, top_logprobs reads the distribution.
  const SamplingParams& p = spec.sampling;
  return spec.top_logprobs > 0 || p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f ||
         p.frequency_penalty != 0.0f;
}

bool Scheduler::CanQueueBehindStepInFlight() const {
  const StepInFlight& newest = *in_flight_.back();
  if (!newest.status.ok() || newest.host_sampling) return false;
  return std::none_of(running_.begin(), running_.end(), [](const std::unique_ptr<Active>& active) {
    return !active->finish && SamplesOnHost(active->spec);
  });
}

bool Scheduler::LaunchStep() {
  // The batch: the final token of finished session requests, one decode token per running
  // sequence, and prefill chunks within the budget.
  auto owned_step = std::make_unique<StepInFlight>();
  StepInFlight& step = *owned_step;
  step.id = next_step_id_++;
  const StepInFlight* behind = in_flight_.empty() ? nullptr : in_flight_.back().get();
  int64_t prefill_budget = options_.prefill_tokens_per_step;
  for (auto& owned : running_) {
    Active& active = *owned;
    if (active.finish && !active.absorbing_final) {
      if (active.session != nullptr && !active.last_output_fed) {
        active.absorbing_final = true;
      } else {
        continue;
      }
    }
    if (active.absorbing_final) {
      step.batch.push_back({active.slot, std::span(&active.output.back(), 1)});
      step.rows.push_back({&active, RowKind::kFinalToken, /*samples=*/false});
    } else if (active.prefilling()) {
      if (prefill_budget <= 0) continue;
      const size_t n = std::min<size_t>(prefill_budget, active.spec.prompt.size() - active.fed);
      step.batch.push_back({active.slot, std::span(active.spec.prompt).subspan(active.fed, n)});
      active.fed += n;
      step.rows.push_back({&active, RowKind::kPrompt, active.fed == active.spec.prompt.size()});
      prefill_budget -= n;
      step.prefill_tokens += n;
    } else if (behind != nullptr && active.chosen_in_step == behind->id) {
      // The step in flight chooses this request's next token: take it on the engine. If that
      // token is the request's last by length, only a session needs it (absorbed, not sampled
      // from); a request may also end on it by EOS or a stop token, and then this row's token is
      // dropped when the step is collected.
      const bool last = static_cast<int32_t>(active.output.size()) + 1 >=
                        active.spec.stop.max_new_tokens;
      if (last && active.session == nullptr) continue;
      step.batch.push_back({.slot = active.slot, .tokens = {}, .takes_token_in_flight = true});
      step.rows.push_back({&active, last ? RowKind::kFinalToken : RowKind::kDecode, !last});
      active.chosen_taken_ahead = true;
    } else {
      step.batch.push_back({active.slot, std::span(&active.output.back(), 1)});
      step.rows.push_back({&active, RowKind::kDecode, /*samples=*/true});
    }
  }
  if (step.batch.empty()) return false;
  for (const Row& row : step.rows) {
    Active& active = *row.owner;
    ++active.rows_in_flight;
    if (row.kind != RowKind::kPrompt) active.last_output_fed = true;
    if (row.samples) active.chosen_in_step = step.id;
    // Tokens are chosen on the engine (only ids come back) unless a request needs the logits.
    // Such a step runs at once.
    if (row.samples && SamplesOnHost(active.spec)) step.host_sampling = true;
  }
  ChargeTime(SchedulerPhase::kBatch);
  step.start = absl::Now();
  if (step.host_sampling) {
    step.status = engine_->Forward(step.batch, LogitsFor::kLastToken, &step.logits);
  } else {
    std::vector<SamplingParams> params;
    params.reserve(step.rows.size());
    for (const Row& row : step.rows) {
      params.push_back(row.samples ? row.owner->spec.sampling : SamplingParams{});
    }
    step.status = engine_->StartForwardAndSample(step.batch, params);
  }
  in_flight_.push_back(std::move(owned_step));
  return true;
}

void Scheduler::CompleteStep() {
  const std::unique_ptr<StepInFlight> collected = std::move(in_flight_.front());
  in_flight_.pop_front();
  StepInFlight& step = *collected;
  std::vector<GeneratedToken> chosen(step.batch.size());
  const int64_t V = engine_->config().vocab_size;
  if (!step.status.ok()) {
    // Nothing was queued.
  } else if (step.host_sampling) {
    for (size_t i = 0; i < step.rows.size(); ++i) {
      if (!step.rows[i].samples) continue;
      const Active& active = *step.rows[i].owner;
      std::span<const float> row = std::span(step.logits).subspan(i * V, V);
      const uint64_t draw = *engine_->SequenceLength(active.slot);
      const SampledToken token =
          SampleToken(row, active.spec.sampling, active.spec.prompt, active.output, draw);
      chosen[i] = {token.id, token.logprob, {}};
      if (active.spec.top_logprobs > 0) {
        chosen[i].top_logprobs = TopLogprobs(row, active.spec.top_logprobs);
      }
    }
  } else {
    std::vector<SampledToken> sampled;
    step.status = engine_->FinishForwardAndSample(&sampled);
    ChargeTime(SchedulerPhase::kEngineWait);
    for (size_t i = 0; step.status.ok() && i < sampled.size(); ++i) {
      chosen[i] = {sampled[i].id, sampled[i].logprob, {}};
    }
  }
  const absl::Time step_end = absl::Now();
  if (metrics_ != nullptr) {
    // A step queued behind another starts when that one ends.
    const absl::Duration took = step_end - std::max(step.start, previous_step_end_);
    metrics_->StepFinished(static_cast<int64_t>(step.batch.size()), step.prefill_tokens, took,
                           engine_->CollectedStepDeviceTime(),
                           engine_->CollectedStepReplayedGraph());
  }
  previous_step_end_ = step_end;

  for (size_t i = 0; i < step.rows.size(); ++i) {
    const Row& row = step.rows[i];
    Active& active = *row.owner;
    --active.rows_in_flight;
    const bool taken_ahead = row.samples && std::exchange(active.chosen_taken_ahead, false);
    if (!step.status.ok()) {
      if (!active.finish) Finish(active, FinishReason::kCancelled, step.status);
      active.absorbing_final = false;
      active.last_output_fed = true;
      continue;
    }
    switch (row.kind) {
      case RowKind::kFinalToken:
        active.absorbing_final = false;
        continue;
      case RowKind::kPrompt:
        if (metrics_ != nullptr) metrics_->PromptTokens(step.batch[i].tokens.size());
        break;
      case RowKind::kDecode:
        break;
    }
    // A request that ended while the step ran (cancelled, past its deadline, or on the token
    // before, when this row took it on the engine) keeps what its state absorbed but not the
    // token chosen after it.
    if (!row.samples || active.finish) continue;
    const GeneratedToken& token = chosen[i];
    active.output.push_back(token.id);
    active.last_output_fed = taken_ahead;
    const bool first = active.output.size() == 1;
    if (first) active.first_token = step_end;
    const absl::Duration since_previous = step_end - (first ? active.arrival : active.last_token);
    active.last_token = step_end;
    const StopConditions& stop = active.spec.stop;
    std::optional<FinishReason> reason;
    if (token.id == engine_->config().eos_token_id && !stop.ignore_eos) {
      reason = FinishReason::kEos;
    } else if (std::find(stop.stop_token_ids.begin(), stop.stop_token_ids.end(), token.id) !=
               stop.stop_token_ids.end()) {
      reason = FinishReason::kStop;
    } else if (static_cast<int32_t>(active.output.size()) >= stop.max_new_tokens) {
      reason = FinishReason::kLength;
    }
    // The token's metrics are observed on the delivery thread, off the engine's critical path,
    // and before the caller can see the token.
    auto count_token = [metrics = metrics_, first, since_previous] {
      if (metrics != nullptr) metrics->TokenGenerated(first, since_previous);
    };
    if (reason.has_value()) {
      outbox_.push_back(std::move(count_token));
      Finish(active, *reason, absl::OkStatus(), {token});
    } else {
      outbox_.push_back([count_token, handle = active.handle, token] {
        count_token();
        handle->Push({token});
      });
    }
  }
  ChargeTime(SchedulerPhase::kCollect);
}

void Scheduler::ReleaseFinished() {
  // Requests that are done (and, for sessions, have absorbed their last token) leave once no
  // step in flight has a row of theirs.
  for (auto it = running_.begin(); it != running_.end();) {
    Active& active = **it;
    const bool done = active.finish && active.rows_in_flight == 0 &&
                      (active.session == nullptr || active.last_output_fed);
    if (done) {
      ReleaseActive(active);
      it = running_.erase(it);
    } else {
      ++it;
    }
  }

  SchedulerStats stats;
  stats.running = static_cast<int64_t>(running_.size());
  stats.waiting = static_cast<int64_t>(waiting_.size());
  stats.sessions_engine = resident_sessions_;
  stats.sessions_host = static_cast<int64_t>(sessions_.size()) - resident_sessions_;
  int64_t fresh_slots = 0;
  for (const auto& active : running_) fresh_slots += active->session == nullptr;
  stats.slots_used = stats.sessions_engine + fresh_slots;
  stats.host_session_bytes = host_session_bytes_;
  if (metrics_ != nullptr) {
    metrics_->SchedulerState(stats, engine_->state_bytes(), engine_->max_sequences());
  }
  absl::MutexLock lock(&mutex_);
  stats_ = stats;
}

// ---- Sessions ---------------------------------------------------------------------------------

SessionInfo Scheduler::InfoOf(const Session& session) const {
  SessionInfo info;
  info.id = session.id;
  info.tier = session.slot >= 0 ? SessionTier::kEngine : SessionTier::kHost;
  info.tokens_absorbed =
      session.slot >= 0 ? *engine_->SequenceLength(session.slot) : session.length;
  info.last_used = session.last_used;
  info.busy = session.busy;
  return info;
}

absl::StatusOr<Scheduler::Session*> Scheduler::FindSession(const std::string& id,
                                                           std::string_view field,
                                                           bool must_be_idle) {
  auto found = sessions_.find(id);
  if (found == sessions_.end()) {
    return absl::NotFoundError(absl::StrCat(AbslView(field), ": no session '", id, "'"));
  }
  if (must_be_idle && found->second->busy) {
    return absl::AbortedError(absl::StrCat(AbslView(field), ": session '", id,
                                           "' is busy with another request"));
  }
  return found->second.get();
}

SessionInfo Scheduler::AddSession(const std::string& id, SequenceSlot slot) {
  auto session = std::make_unique<Session>();
  session->id = id;
  session->slot = slot;
  ++resident_sessions_;
  session->length = *engine_->SequenceLength(slot);
  session->last_used = absl::Now();
  const SessionInfo info = InfoOf(*session);
  sessions_[id] = std::move(session);
  return info;
}

absl::StatusOr<std::string> Scheduler::NewSessionId(std::string requested) {
  if (requested.empty()) {
    do {
      requested = absl::StrCat("s-", ++next_session_number_);
    } while (sessions_.contains(requested));
    return requested;
  }
  if (sessions_.contains(requested)) {
    return absl::AlreadyExistsError(absl::StrCat("session_id: '", requested, "' exists"));
  }
  return requested;
}

absl::StatusOr<SessionInfo> Scheduler::CreateSession(std::string id) {
  SessionInfo info;
  TTT_RETURN_IF_ERROR(RunOnEngineThread([&]() -> absl::Status {
    TTT_ASSIGN_OR_RETURN(std::string new_id, NewSessionId(std::move(id)));
    TTT_ASSIGN_OR_RETURN(SequenceSlot slot, CreateSlot(nullptr));
    info = AddSession(new_id, slot);
    return absl::OkStatus();
  }));
  return info;
}

absl::StatusOr<SessionInfo> Scheduler::ForkSession(const std::string& source, std::string id) {
  SessionInfo info;
  TTT_RETURN_IF_ERROR(RunOnEngineThread([&]() -> absl::Status {
    TTT_ASSIGN_OR_RETURN(Session * original, FindSession(source, "source_session_id", true));
    TTT_ASSIGN_OR_RETURN(std::string new_id, NewSessionId(std::move(id)));
    TTT_RETURN_IF_ERROR(MakeResident(*original));
    TTT_ASSIGN_OR_RETURN(SequenceSlot slot, ForkSlot(original->slot, original));
    original->last_used = absl::Now();
    info = AddSession(new_id, slot);
    return absl::OkStatus();
  }));
  return info;
}

absl::StatusOr<SessionInfo> Scheduler::GetSession(const std::string& id) {
  SessionInfo info;
  TTT_RETURN_IF_ERROR(RunOnEngineThread([&]() -> absl::Status {
    TTT_ASSIGN_OR_RETURN(Session * session, FindSession(id, "session_id", false));
    info = InfoOf(*session);
    return absl::OkStatus();
  }));
  return info;
}

absl::Status Scheduler::DeleteSession(const std::string& id) {
  return RunOnEngineThread([&]() -> absl::Status {
    TTT_ASSIGN_OR_RETURN(Session * session, FindSession(id, "session_id", true));
    if (session->slot >= 0) {
      TTT_RETURN_IF_ERROR(engine_->ReleaseSequence(session->slot));
      --resident_sessions_;
    }
    host_session_bytes_ -= session->saved_state.size();
    sessions_.erase(id);
    return absl::OkStatus();
  });
}

absl::StatusOr<std::string> Scheduler::ExportSession(const std::string& id,
                                                     int64_t* tokens_absorbed) {
  std::string bytes;
  TTT_RETURN_IF_ERROR(RunOnEngineThread([&]() -> absl::Status {
    TTT_ASSIGN_OR_RETURN(Session * session, FindSession(id, "session_id", true));
    if (session->slot >= 0) {
      TTT_ASSIGN_OR_RETURN(bytes, engine_->SaveSequence(session->slot));
      *tokens_absorbed = *engine_->SequenceLength(session->slot);
    } else {
      bytes = session->saved_state;
      *tokens_absorbed = session->length;
    }
    return absl::OkStatus();
  }));
  return bytes;
}

absl::StatusOr<SessionInfo> Scheduler::ImportSession(std::string_view state, std::string id) {
  SessionInfo info;
  TTT_RETURN_IF_ERROR(RunOnEngineThread([&]() -> absl::Status {
    TTT_ASSIGN_OR_RETURN(std::string new_id, NewSessionId(std::move(id)));
    absl::StatusOr<SequenceSlot> slot;
    while (true) {
      slot = engine_->RestoreSequence(state);
      if (slot.ok() || slot.status().code() != absl::StatusCode::kResourceExhausted) break;
      TTT_RETURN_IF_ERROR(EvictOneIdleSession(nullptr));
    }
    if (!slot.ok()) {
      return absl::Status(slot.status().code(), absl::StrCat("state: ", slot.status().message()));
    }
    info = AddSession(new_id, *slot);
    return absl::OkStatus();
  }));
  return info;
}

}  // namespace ttt
