// SharedSlots (dist/shm.h): the exchange protocol between ranks, one thread each, and its
// failures: a rank that never arrives, and a rank whose process exits.
#include "weft/dist/shm.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>
#include <vector>

#include "weft/core/error.h"

namespace weft::dist {
namespace {

using std::chrono::milliseconds;

// Every rank's group member: rank 0 makes the segment, the others open it.
std::vector<std::unique_ptr<SharedSlots>> connect(int size, size_t slot_bytes) {
  std::vector<std::unique_ptr<SharedSlots>> g;
  std::string why;
  g.push_back(SharedSlots::create(size, slot_bytes, &why));
  EXPECT_TRUE(g[0]) << why;
  for (int r = 1; r < size; ++r) {
    g.push_back(SharedSlots::open(g[0]->name(), g[0]->nonce(), r, size, &why));
    EXPECT_TRUE(g.back()) << why;
  }
  g[0]->unlink();
  return g;
}

// Many exchanges back to back: each rank reads exactly what every rank wrote in that exchange
// (the two slot sets alternate without one rank's next write reaching a slot still being read).
TEST(SharedSlots, ExchangesDeliverEveryRanksBytes) {
  const int size = 3;
  auto g = connect(size, 4096);
  ASSERT_TRUE(g[0] && g[1] && g[2]);
  std::vector<std::thread> threads;
  std::vector<int64_t> wrong(size, 0);
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      for (uint32_t k = 0; k < 2000; ++k)
        g[r]->exchange(
            k % 7,
            [&](char* mine) {
              for (size_t i = 0; i < 4096 / 4; ++i) {
                const uint32_t v =
                    k * 131 + static_cast<uint32_t>(r) * 7 + static_cast<uint32_t>(i);
                std::memcpy(mine + 4 * i, &v, 4);
              }
            },
            [&](const char* const* slots) {
              for (int q = 0; q < size; ++q)
                for (size_t i = 0; i < 4096 / 4; i += 97) {
                  uint32_t v;
                  std::memcpy(&v, slots[q] + 4 * i, 4);
                  wrong[r] +=
                      v != k * 131 + static_cast<uint32_t>(q) * 7 + static_cast<uint32_t>(i);
                }
            },
            "test", milliseconds(60000));
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong, std::vector<int64_t>(size, 0));
}

TEST(SharedSlots, OpenChecksTheSegment) {
  std::string why;
  auto a = SharedSlots::create(2, 4096, &why);
  ASSERT_TRUE(a) << why;
  EXPECT_FALSE(SharedSlots::open(a->name(), a->nonce() + 1, 1, 2, &why));
  EXPECT_NE(why.find("not the one rank 0 made"), std::string::npos) << why;
  EXPECT_FALSE(SharedSlots::open(a->name(), a->nonce(), 1, 3, &why));  // another group size
  a->unlink();
  EXPECT_FALSE(SharedSlots::open(a->name(), a->nonce(), 1, 2, &why));  // gone from /dev/shm
  EXPECT_NE(why.find("shm_open"), std::string::npos) << why;
}

// A rank that never arrives: the others end with an error naming it when the timeout passes,
// and every later exchange of the group is an error at once.
TEST(SharedSlots, ALateRankEndsTheWaitWithAnError) {
  auto g = connect(2, 4096);
  ASSERT_TRUE(g[0] && g[1]);
  try {
    g[0]->exchange(
        1, [](char*) {}, [](const char* const*) {}, "all_reduce_sum", milliseconds(300));
    ADD_FAILURE() << "no error";
  } catch (const weft::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank(s) 1 did not arrive within 0.3 s"), std::string::npos) << m;
    EXPECT_NE(m.find("all_reduce_sum"), std::string::npos) << m;
  }
  EXPECT_THROW(g[0]->exchange(
                   1, [](char*) {}, [](const char* const*) {}, "x", milliseconds(300)),
               weft::Error);
}

// A rank whose process exits: the waiting rank says so well before its timeout (a minute here),
// from the process's state, rather than waiting the minute out.
TEST(SharedSlots, ARankWhoseProcessExitedIsNamed) {
  std::string why;
  auto a = SharedSlots::create(2, 4096, &why);
  ASSERT_TRUE(a) << why;
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 1: opens the segment and exits without a collective
    std::string w;
    auto b = SharedSlots::open(a->name(), a->nonce(), 1, 2, &w);
    ::_exit(b ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  a->unlink();
  try {
    a->exchange(
        1, [](char*) {}, [](const char* const*) {}, "all_gather", milliseconds(60000));
    ADD_FAILURE() << "no error";
  } catch (const weft::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("rank 1 (process " + std::to_string(child) + ") exited"), std::string::npos)
        << m;
  }
}

}  // namespace
}  // namespace weft::dist
