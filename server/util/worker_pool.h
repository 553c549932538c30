// Runs posted tasks on a fixed set of threads: in the order posted with one thread, in no
// particular order with more.
#pragma once

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ttt {

class WorkerPool {
 public:
  using Task = std::function<void()>;

  // `name` names the threads (at most 15 characters with their number).
  WorkerPool(int threads, const std::string& name);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool();  // Runs everything posted, then stops.

  void Post(Task task);

 private:
  void Loop(const std::string& name);

  absl::Mutex mutex_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mutex_);
  bool stopping_ ABSL_GUARDED_BY(mutex_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ttt
