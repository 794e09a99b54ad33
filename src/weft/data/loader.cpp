#include "weft/data/loader.h"

#include <algorithm>
#include <utility>

namespace weft::data {

Prefetcher::Prefetcher(int workers, std::function<at::Tensor(const Key&)> make)
    : make_(std::move(make)) {
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

void Prefetcher::schedule(const std::vector<Key>& keys, int64_t step) {
  if (threads_.empty()) return;  // no workers: take() makes each item when asked
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Key& k : keys) {
      auto it = pending_.find(k);
      if (it != pending_.end()) {
        it->second.step = std::max(it->second.step, step);
        continue;
      }
      std::packaged_task<at::Tensor()> task([this, k] { return make_(k); });
      pending_.emplace(k, Entry{task.get_future(), step});
      queue_.emplace_back(k, std::move(task));
    }
  }
  cv_.notify_all();
}

at::Tensor Prefetcher::take(const Key& key) {
  std::future<at::Tensor> f;
  std::packaged_task<at::Tensor()> queued;
  {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = pending_.find(key);
    if (it == pending_.end()) {  // never scheduled (or no workers): made here, unlocked
      lock.unlock();
      return make_(key);
    }
    f = std::move(it->second.result);
    pending_.erase(it);
    // Not started yet: run it here rather than wait behind later steps' items.
    auto q = std::find_if(queue_.begin(), queue_.end(),
                          [&](const auto& entry) { return entry.first == key; });
    if (q != queue_.end()) {
      queued = std::move(q->second);
      queue_.erase(q);
    }
  }
  if (queued.valid()) queued();
  return f.get();
}

void Prefetcher::forget_before(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = pending_.begin(); it != pending_.end();)
    it = it->second.step < step ? pending_.erase(it) : std::next(it);
  // Queued tasks nobody will take are not run.
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(),
                              [&](const auto& q) { return pending_.count(q.first) == 0; }),
               queue_.end());
}

size_t Prefetcher::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

void Prefetcher::work() {
  for (;;) {
    std::packaged_task<at::Tensor()> task;
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
