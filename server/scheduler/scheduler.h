// Continuous batching over one engine, on its own thread.
//
// Each step decodes one token for every running sequence and spends a token budget on prefill
// chunks of the others (so a long prompt never stalls the rest); requests join and leave at any
// step. Admission is by state slot: when none is free, the least recently used idle session is
// evicted to host memory (and brought back when used). Sessions are named states that outlive a
// request; every engine call, session operations included, runs on the scheduler's thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/engine/engine.h"
#include "server/engine/sampler.h"
#include "server/scheduler/delivery_thread.h"

namespace ttt {

class Metrics;
enum class SchedulerPhase;

struct SchedulerOptions {
  int64_t max_waiting = 1024;            // Waiting requests beyond this: RESOURCE_EXHAUSTED.
  int64_t prefill_tokens_per_step = 2048;  // Prefill budget of one step.
  // While sequences decode, an arriving request waits up to this many steps for others to join
  // with it (0: it joins at the next step). A step that takes prompts costs much more than a
  // decode step whatever their number (bench/README.md, v65), so one such step for several
  // arrivals costs less than one each. Arrivals join at once when nothing decodes, when the next
  // step takes prompts anyway, or when they are as many as the sequences decoding.
  int64_t max_join_wait_steps = 0;
  int64_t max_host_session_bytes = int64_t{8} << 30;  // Evicted sessions kept in host memory.
  int64_t max_context_tokens = 0;        // 0: no limit.
  int32_t default_max_new_tokens = 256;
};

enum class FinishReason { kLength, kEos, kStop, kCancelled };

struct StopConditions {
  int32_t max_new_tokens = 0;  // 0: the scheduler's default.
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

// A validated generation request.
struct GenerationSpec {
  std::vector<int32_t> prompt;  // Non-empty.
  std::string session_id;       // Empty: a fresh sequence, released at the end.
  SamplingParams sampling;
  StopConditions stop;
  int32_t top_logprobs = 0;
  absl::Time deadline = absl::InfiniteFuture();
};

struct GeneratedToken {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top_logprobs;  // Most likely first.
};

struct GenerationTimes {
  int32_t prompt_tokens = 0;
  int32_t generated_tokens = 0;
  absl::Duration queue, time_to_first_token, total;
};

// What the scheduler has produced for a request since the last Next: tokens, then once the end
// (a finish reason, or an error status such as DEADLINE_EXCEEDED).
struct GenerationUpdate {
  std::vector<GeneratedToken> tokens;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kLength;
  absl::Status status;
  GenerationTimes times;
};

// The link between a request's caller and the scheduler.
class GenerationHandle {
 public:
  // Waits up to `timeout` for news: the end, at least `min_tokens` tokens, or tokens the oldest
  // of which has waited `max_hold` since it came. False when there is none yet.
  bool Next(absl::Duration timeout, GenerationUpdate* update, size_t min_tokens = 1,
            absl::Duration max_hold = absl::InfiniteDuration());
  // Asks the scheduler to stop this request at its next step: kStop (the caller saw a stop
  // string) or kCancelled (the caller went away: its slot is freed).
  void Cancel(FinishReason reason);

 private:
  friend class Scheduler;
  void Push(std::vector<GeneratedToken> tokens);
  // The end, with the request's last tokens in the same update.
  void Finish(std::vector<GeneratedToken> tokens, FinishReason reason, absl::Status status,
              const GenerationTimes& times);
  bool cancel_requested(FinishReason* reason);

  absl::Mutex mutex_;
  GenerationUpdate pending_ ABSL_GUARDED_BY(mutex_);
  absl::Time oldest_pending_ ABSL_GUARDED_BY(mutex_);  // When pending_.tokens' first came.
  bool has_news_ ABSL_GUARDED_BY(mutex_) = false;
  std::atomic<bool> cancel_ = false;  // Set (under mutex_) after cancel_reason_.
  FinishReason cancel_reason_ ABSL_GUARDED_BY(mutex_) = FinishReason::kCancelled;
};

enum class SessionTier { kEngine, kHost };

struct SessionInfo {
  std::string id;
  int64_t tokens_absorbed = 0;
  SessionTier tier = SessionTier::kEngine;
  absl::Time last_used;
  bool busy = false;
};

struct SchedulerStats {
  int64_t running = 0, waiting = 0;
  int64_t slots_used = 0;
  int64_t sessions_engine = 0, sessions_host = 0;
  int64_t host_session_bytes = 0;
};

class Scheduler {
 public:
  Scheduler(std::unique_ptr<Engine> engine, SchedulerOptions options, Metrics* metrics = nullptr);
  ~Scheduler();  // Cancels what is left and stops the thread.

  const Engine& engine() const { return *engine_; }
  const SchedulerOptions& options() const { return options_; }

  // Queues a generation: RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when draining.
  // Later errors arrive through the handle: NOT_FOUND / ABORTED for a missing / busy session
  // (a session serves one request at a time; a second one is refused, not queued),
  // INVALID_ARGUMENT past max_context_tokens, RESOURCE_EXHAUSTED when no slot can be had,
  // DEADLINE_EXCEEDED.
  absl::StatusOr<std::shared_ptr<GenerationHandle>> Submit(GenerationSpec spec);

  absl::StatusOr<SessionInfo> CreateSession(std::string id);
  absl::StatusOr<SessionInfo> ForkSession(const std::string& source, std::string id);
  absl::StatusOr<SessionInfo> GetSession(const std::string& id);
  absl::Status DeleteSession(const std::string& id);
  absl::StatusOr<std::string> ExportSession(const std::string& id, int64_t* tokens_absorbed);
  absl::StatusOr<SessionInfo> ImportSession(std::string_view state, std::string id);

  SchedulerStats Stats();
  // Refuses new work from now on; work in progress continues.
  void Drain();
  // Finishes every request still in progress with kCancelled.
  void CancelAll();
  // Whether nothing is running or waiting.
  bool Idle();

 private:
  struct Session;
  struct Active;
  enum class RowKind;
  struct Row;
  struct StepInFlight;

  void Loop();
  // One turn of the loop, in this order: Prepare while the engine computes the step in flight
  // (sessions bound, cancellations, admission), LaunchStep to queue the next step behind it,
  // CompleteStep to collect the older step's tokens (and decide which requests end),
  // ReleaseFinished to free what ended.
  void Prepare();
  // Collects the oldest step in flight.
  void CompleteStep();
  // Queues the next step; false when no request has anything to feed.
  bool LaunchStep();
  void ReleaseFinished();
  // Whether the next step may be queued behind the newest in flight, taking its tokens on the
  // engine: not when either samples on the host.
  bool CanQueueBehindStepInFlight() const;
  // Whether the waiting requests join the running ones in the next step (max_join_wait_steps).
  bool JoinNow() const;
  // Whether a request's tokens are chosen on the host, from the logits.
  static bool SamplesOnHost(const GenerationSpec& spec);
  // Adds the time since the previous call to `phase` in the metrics.
  void ChargeTime(SchedulerPhase phase);
  // Runs `task` on the scheduler thread and waits for it.
  absl::Status RunOnEngineThread(std::function<absl::Status()> task);
  // A free slot for `active`: fresh, or its session's (restored from host memory if evicted).
  absl::StatusOr<SequenceSlot> Admit(Active& active);
  // Makes a session resident, evicting idle ones if need be.
  absl::Status MakeResident(Session& session);
  absl::Status EvictOneIdleSession(const Session* keep);
  absl::StatusOr<SequenceSlot> CreateSlot(const Session* keep);
  absl::StatusOr<SequenceSlot> ForkSlot(SequenceSlot source, const Session* keep);
  absl::StatusOr<std::string> NewSessionId(std::string requested);
  // NotFound naming `field`, or Aborted when `must_be_idle` and a request is using it.
  absl::StatusOr<Session*> FindSession(const std::string& id, std::string_view field,
                                       bool must_be_idle);
  // Registers a new resident session over `slot`.
  SessionInfo AddSession(const std::string& id, SequenceSlot slot);
  SessionInfo InfoOf(const Session& session) const;
  void Finish(Active& active, FinishReason reason, absl::Status status,
              std::vector<GeneratedToken> last_tokens = {});
  void ReleaseActive(Active& active);

  std::unique_ptr<Engine> engine_;
  const SchedulerOptions options_;
  Metrics* const metrics_;

  absl::Mutex mutex_;  // Guards what callers hand over; the engine is the thread's alone.
  std::deque<std::unique_ptr<Active>> incoming_ ABSL_GUARDED_BY(mutex_);
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mutex_);
  bool draining_ ABSL_GUARDED_BY(mutex_) = false;
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  bool cancel_all_ ABSL_GUARDED_BY(mutex_) = false;
  SchedulerStats stats_ ABSL_GUARDED_BY(mutex_);

  // The scheduler thread's own (session operations reach them through RunOnEngineThread).
  std::map<std::string, std::unique_ptr<Session>> sessions_;
  std::deque<std::unique_ptr<Active>> waiting_;
  std::vector<std::unique_ptr<Active>> running_;
  int64_t host_session_bytes_ = 0;
  int64_t resident_sessions_ = 0;  // Sessions whose state is in an engine slot.
  uint64_t next_session_number_ = 0;
  absl::Time phase_start_;  // Of the loop's current part, for ChargeTime.
  // Queued on the engine, tokens not collected yet, oldest first (at most two).
  std::deque<std::unique_ptr<StepInFlight>> in_flight_;
  uint64_t next_step_id_ = 1;
  absl::Time previous_step_end_;  // When the latest step was collected.
  // Hand-offs to callers produced by the current step, posted to `delivery_` when it ends.
  std::vector<DeliveryThread::Delivery> outbox_;

  DeliveryThread delivery_;  // Outlives the scheduler thread, which posts to it.
  std::thread thread_;
};

}  // namespace ttt
