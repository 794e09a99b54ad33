// Prefetcher: a pool of worker threads that prepares samples ahead of the training step.
// Positions (a global sample index: step * batch + i) are made by `make`, which must be a pure,
// thread-safe function of the position; take() returns them in any order the caller asks,
// waiting only for what is not ready yet, and rethrows what `make` threw. The destructor stops
// the workers (pending positions are dropped). One thread calls schedule()/take().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "weft/data/sample.h"

namespace weft::data {

class Prefetcher {
 public:
  Prefetcher(int workers, std::function<Sample(int64_t position)> make);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // Queues positions [begin, end) not queued yet, in order.
  void schedule(int64_t begin, int64_t end);
  // The sample at `position` (queued now if it was not), forgetting it.
  Sample take(int64_t position);

 private:
  void work();

  std::function<Sample(int64_t)> make_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<int64_t, std::packaged_task<Sample()>>> queue_;
  std::map<int64_t, std::future<Sample>> pending_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace weft::data
