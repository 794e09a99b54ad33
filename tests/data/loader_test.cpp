// The media prefetcher: items decode on worker threads ahead of the step that wants them, are
// taken once, and what a step scheduled but never took is dropped without being decoded.
#include "weft/data/loader.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
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

}  // namespace
}  // namespace weft::data
