// The media prefetcher: items decode on worker threads ahead of the step that wants them, are
// taken once, and what a step scheduled but never took is dropped without being decoded.
#include "weft/data/loader.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "weft/core/error.h"

namespace weft::data {
namespace {

using Key = Prefetcher::Key;

at::Tensor value_of(const Key& k) {
  return torch::full(
      {2}, static_cast<double>(std::get<0>(k) * 100 + std::get<1>(k) * 10 + std::get<2>(k)));
}

TEST(Prefetcher, TakesScheduledAndUnscheduledItems) {
  std::atomic<int> made{0};
  Prefetcher p(2, [&](const Key& k) {
    ++made;
    return value_of(k);
  });
  p.schedule({{1, 0, 0}, {1, 1, 0}, {2, 0, 1}}, /*step=*/0);
  p.schedule({{1, 0, 0}}, 3);  // already queued: kept once, for step 3
  EXPECT_EQ(p.pending(), 3u);
  EXPECT_TRUE(torch::equal(p.take({2, 0, 1}), value_of({2, 0, 1})));
  EXPECT_TRUE(torch::equal(p.take({7, 1, 2}), value_of({7, 1, 2})));  // never scheduled
  EXPECT_EQ(p.pending(), 2u);
  p.forget_before(1);  // {1, 1, 0} was for step 0 and not taken; {1, 0, 0} is wanted at 3
  EXPECT_EQ(p.pending(), 1u);
  EXPECT_TRUE(torch::equal(p.take({1, 0, 0}), value_of({1, 0, 0})));
  EXPECT_EQ(p.pending(), 0u);
  EXPECT_LE(made.load(), 4);
}

TEST(Prefetcher, RethrowsWhatMakeThrew) {
  Prefetcher p(1, [](const Key& k) -> at::Tensor {
    if (std::get<0>(k) == 5) WEFT_FAIL("record 5 is corrupt");
    return value_of(k);
  });
  p.schedule({{5, 0, 0}, {6, 0, 0}}, 0);
  try {
    p.take({5, 0, 0});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("record 5 is corrupt"), std::string::npos);
  }
  EXPECT_TRUE(torch::equal(p.take({6, 0, 0}), value_of({6, 0, 0})));
}

TEST(Prefetcher, ForgottenItemsAreNotDecoded) {
  std::atomic<bool> release{false};
  std::atomic<int> made{0};
  {
    Prefetcher p(1, [&](const Key& k) {
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      ++made;
      return value_of(k);
    });
    p.schedule({{1, 0, 0}, {2, 0, 0}, {3, 0, 0}}, 0);  // the worker blocks in one of them
    p.forget_before(1);
    EXPECT_EQ(p.pending(), 0u);
    release = true;
    EXPECT_TRUE(torch::equal(p.take({9, 0, 0}), value_of({9, 0, 0})));  // made on this thread
  }                                                                     // the worker is joined
  EXPECT_LE(made.load(), 2);  // at most the one already running, and the one taken
}

// An item no worker has started is made by the thread that takes it, not after the items queued
// before it (a step's own items after a re-layout, behind later steps' prefetches).
TEST(Prefetcher, TakingAnItemNotStartedMakesItHere) {
  std::atomic<bool> release{false};
  std::thread::id maker;
  std::mutex mu;
  Prefetcher p(1, [&](const Key& k) {
    if (std::get<0>(k) == 1)  // the worker's first item blocks until released
      while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (std::get<0>(k) == 2) {
      std::lock_guard<std::mutex> lock(mu);
      maker = std::this_thread::get_id();
    }
    return value_of(k);
  });
  p.schedule({{1, 0, 0}}, 0);
  while (p.pending() != 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the worker is inside item 1
  p.schedule({{2, 0, 0}}, 0);
  std::thread safety([&] {  // a regression waits for the worker instead of hanging the test
    for (int i = 0; i < 5000 && !release; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    release = true;
  });
  EXPECT_TRUE(torch::equal(p.take({2, 0, 0}), value_of({2, 0, 0})));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(maker, std::this_thread::get_id());
  }
  release = true;
  EXPECT_TRUE(torch::equal(p.take({1, 0, 0}), value_of({1, 0, 0})));
  safety.join();
}

}  // namespace
}  // namespace weft::data
