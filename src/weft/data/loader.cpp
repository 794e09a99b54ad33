#include "weft/data/loader.h"

#include <utility>

namespace weft::data {

Prefetcher::Prefetcher(int workers, std::function<Sample(int64_t)> make) : make_(std::move(make)) {
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    queue_.clear();
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void Prefetcher::schedule(int64_t begin, int64_t end) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t p = begin; p < end; ++p) {
      if (pending_.count(p)) continue;
      std::packaged_task<Sample()> task([this, p] { return make_(p); });
      pending_.emplace(p, task.get_future());
      queue_.emplace_back(p, std::move(task));
    }
  }
  cv_.notify_all();
}

Sample Prefetcher::take(int64_t position) {
  std::future<Sample> f;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(position);
    if (it == pending_.end()) {
      lock.unlock();
      if (threads_.empty()) return make_(position);
      schedule(position, position + 1);
      lock.lock();
      it = pending_.find(position);
    }
    f = std::move(it->second);
    pending_.erase(it);
  }
  return f.get();
}

void Prefetcher::work() {
  for (;;) {
    std::packaged_task<Sample()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      task = std::move(queue_.front().second);
      queue_.pop_front();
    }
    task();  // exceptions land in the future
  }
}

}  // namespace weft::data
