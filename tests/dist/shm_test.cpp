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
std::vector<std::unique_ptr<SharedSlots>> connect(int size, size_t slot_bytes,
                                                  size_t ring_bytes = 0) {
  std::vector<std::unique_ptr<SharedSlots>> g;
  std::string why;
  g.push_back(SharedSlots::create(size, slot_bytes, &why, ring_bytes));
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

// Three ranks, each streaming a byte sequence of its own to both others through their rings in
// pieces of changing sizes (so that the 4 KiB rings fill, wrap and drain many times): every
// reader gets exactly its writer's sequence, in order, and no other pair's bytes.
TEST(SharedSlots, RingsCarryEachPairsBytesInOrder) {
  const int size = 3;
  const size_t total = 1 << 20;
  auto g = connect(size, 4096, 4096);
  ASSERT_TRUE(g[0] && g[1] && g[2]);
  EXPECT_EQ(g[1]->ring_bytes(), 4096u);
  auto byte = [](int src, int dst, size_t i) {
    return static_cast<char>((i * 131 + i / 4093 + static_cast<size_t>(src * 7 + dst)) & 0xff);
  };
  std::vector<int64_t> wrong(size, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r)
    threads.emplace_back([&, r] {
      std::vector<size_t> sent(size, 0), got(size, 0);
      std::vector<char> buf(5000);
      const auto until = [] { return std::chrono::steady_clock::now() + milliseconds(60000); };
      for (size_t step = 0;; ++step) {
        bool done = true;
        for (int q = 0; q < size; ++q) {
          if (q == r) continue;
          if (sent[q] < total) {  // write a piece
            const size_t n = std::min<size_t>(total - sent[q], 1 + (step * 977 + q) % 4999);
            for (size_t i = 0; i < n; ++i) buf[i] = byte(r, q, sent[q] + i);
            size_t k = 0;
            while (k < n) {
              const size_t put = g[r]->ring_put(q, buf.data() + k, n - k);
              k += put;
              if (put == 0) {  // full: read what came meanwhile (the peers do the same)
                for (int p = 0; p < size; ++p) {
                  if (p == r) continue;
                  std::vector<char> in(4096);
                  const size_t m = g[r]->ring_get(p, in.data(), in.size());
                  for (size_t i = 0; i < m; ++i) wrong[r] += in[i] != byte(p, r, got[p] + i);
                  got[p] += m;
                }
              }
            }
            sent[q] += n;
          }
          std::vector<char> in(3001);
          const size_t m = g[r]->ring_get(q, in.data(), in.size());
          for (size_t i = 0; i < m; ++i) wrong[r] += in[i] != byte(q, r, got[q] + i);
          got[q] += m;
          done = done && sent[q] == total && got[q] == total;
          if (got[q] < total && sent[q] == total) {
            EXPECT_TRUE(g[r]->ring_wait(q, /*space=*/false, 1, until(), "test"));
          }
        }
        if (done) break;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(wrong, std::vector<int64_t>(size, 0));
  for (int r = 0; r < size; ++r)
    for (int q = 0; q < size; ++q)
      if (q != r) {
        EXPECT_EQ(g[r]->ring_ready(q), 0u);
      }
}

// Waiting on a ring: room that is there, bytes that never come (false at the deadline), and a
// peer whose process exited (an error naming it, well before the deadline).
TEST(SharedSlots, RingWaitsEndAtTheDeadlineOrWithAnExitedPeer) {
  std::string why;
  auto a = SharedSlots::create(2, 4096, &why, 8192);
  ASSERT_TRUE(a) << why;
  const auto soon = [](int ms) { return std::chrono::steady_clock::now() + milliseconds(ms); };
  EXPECT_TRUE(a->ring_wait(1, /*space=*/true, 8192, soon(10), "send"));
  EXPECT_FALSE(a->ring_wait(1, /*space=*/false, 1, soon(100), "recv"));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 1: opens the segment, writes 3 bytes to rank 0, and exits
    std::string w;
    auto b = SharedSlots::open(a->name(), a->nonce(), 1, 2, &w);
    ::_exit(b && b->ring_bytes() == 8192 && b->ring_put(0, "abc", 3) == 3 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  a->unlink();
  char got[4] = {};
  EXPECT_EQ(a->ring_get(1, got, 4), 3u);
  EXPECT_STREQ(got, "abc");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    a->ring_wait(1, /*space=*/false, 1, soon(60000), "recv");
    ADD_FAILURE() << "no error";
  } catch (const weft::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("recv failed: rank 1 (process " + std::to_string(child) + ") exited"),
              std::string::npos)
        << m;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}

}  // namespace
}  // namespace weft::dist
