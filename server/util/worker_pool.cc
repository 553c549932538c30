#include "server/util/worker_pool.h"

#include <pthread.h>

#include <utility>

#include "absl/strings/str_cat.h"

namespace ttt {

WorkerPool::WorkerPool(int threads, const std::string& name) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this, thread_name = absl::StrCat(name, "-", i)] { Loop(thread_name); });
  }
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  for (std::thread& thread : threads_) thread.join();
}

void WorkerPool::Post(Task task) {
  absl::MutexLock lock(&mutex_);
  queue_.push_back(std::move(task));
}

void WorkerPool::Loop(const std::string& name) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mutex_);
      auto has_work = [this] {
        mutex_.AssertHeld();
        return stopping_ || !queue_.empty();
      };
      mutex_.Await(absl::Condition(&has_work));
      if (queue_.empty()) return;  // Stopping, and nothing is left.
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

}  // namespace ttt
