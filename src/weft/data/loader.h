// Prefetcher: a pool of worker threads that decodes media items ahead of the training step.
// An item is named by a key (the dataset's record, the encoder, and which of the record's items
// for that encoder it is); `make` must be a
// pure, thread-safe function of the key. Each scheduled key carries the step that wants it:
// take() returns an item, waiting only if a worker is making it (making it on the calling thread
// if no worker has started it, or it was never scheduled), rethrowing what `make` threw;
// forget_before() drops what earlier steps scheduled and never took (a layout that changed, a
// record found bad). The destructor stops the workers (pending keys are dropped). One thread calls
// everything but the workers.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace weft::data {

class Prefetcher {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t>;  // (record, encoder, nth)

  Prefetcher(int workers, std::function<at::Tensor(const Key&)> make);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Queues the keys not queued yet, in order, for `step` (a key already queued is kept for the
  // later of the two steps).
  void schedule(const std::vector<Key>& keys, int64_t step);
  // The item of `key`, forgetting it.
  at::Tensor take(const Key& key);
  // Drops the keys whose latest step is before `step`, decoded or not.
  void forget_before(int64_t step);
  // Keys scheduled and not yet taken or forgotten.
  size_t pending() const;

 private:
  struct Entry {
    std::future<at::Tensor> result;
    int64_t step = 0;
  };
  void work();

  std::function<at::Tensor(const Key&)> make_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Key, std::packaged_task<at::Tensor()>>> queue_;
  std::map<Key, Entry> pending_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace weft::data
