// Test support: a multi-rank group inside one process, one thread per rank over an in-memory
// store (the c10d test pattern). run_ranks returns when every rank is done and rethrows the
// first failure, so a failed EXPECT/ASSERT or an exception on any rank fails the test.
#pragma once

#include <atomic>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "weft/dist/comm.h"

namespace weft::testing {

inline void run_ranks(int size, const std::function<void(const dist::Comm&)>& fn) {
  static std::atomic<int> groups{0};
  const std::string key = "test_group_" + std::to_string(groups++);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(dist::Comm::in_memory(key, r, size));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace weft::testing
