// Test support: a multi-rank group inside one process, one thread per rank over an in-memory
// store (the c10d test pattern). run_ranks returns when every rank is done and rethrows the
// first failure, so a failed EXPECT/ASSERT or an exception on any rank fails the test. The ranks'
// blocking CPU collectives go through shared memory unless shared_memory is false (Gloo's).
#pragma once

#include <c10/core/AutogradState.h>
#include <torch/version.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "weft/dist/comm.h"

namespace weft::testing {

inline void run_ranks(int size, const std::function<void(const dist::Comm&)>& fn,
                      bool shared_memory = true) {
  static std::atomic<int> groups{0};
  const std::string key = "test_group_" + std::to_string(groups++);
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
#if TORCH_VERSION_MAJOR >= 2
      // The autograd engine runs device (CUDA) nodes on one worker thread per device, shared by
      // every thread of the process: with ranks sharing a GPU, a collective in one rank's
      // backward would block its peer's matching node queued behind it. Each rank thread runs
      // its own backward instead (as PyTorch's threaded process groups do).
      c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
#endif
      try {
        fn(dist::Comm::in_memory(key, r, size, std::chrono::seconds(60), shared_memory));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace weft::testing
