#include "server/scheduler/delivery_thread.h"

#include <pthread.h>

#include <utility>

namespace ttt {

DeliveryThread::DeliveryThread() : thread_([this] { Loop(); }) {}

DeliveryThread::~DeliveryThread() {
  {
    absl::MutexLock lock(&mutex_);
    stopping_ = true;
  }
  thread_.join();
}

void DeliveryThread::Post(std::vector<Delivery> batch) {
  if (batch.empty()) return;
  absl::MutexLock lock(&mutex_);
  queue_.push_back(std::move(batch));
}

void DeliveryThread::Loop() {
  pthread_setname_np(pthread_self(), "ttt-delivery");
  while (true) {
    std::deque<std::vector<Delivery>> batches;
    {
      absl::MutexLock lock(&mutex_);
      auto has_work = [this] {
        mutex_.AssertHeld();
        return stopping_ || !queue_.empty();
      };
      mutex_.Await(absl::Condition(&has_work));
      if (queue_.empty()) return;  // Stopping, and nothing is left.
      batches.swap(queue_);
    }
    for (std::vector<Delivery>& batch : batches) {
      for (Delivery& deliver : batch) deliver();
    }
  }
}

}  // namespace ttt
