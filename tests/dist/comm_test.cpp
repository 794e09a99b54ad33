// Comm over real Gloo groups, one thread per rank in one process (in-memory store).
#include "weft/dist/comm.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "support/errors.h"
#include "support/ranks.h"
#include "weft/core/error.h"
#include "weft/dist/collectives.h"

namespace weft::dist {
namespace {

using weft::testing::error_of;
using weft::testing::run_ranks;

TEST(Comm, SingleRankIsTheIdentity) {
  Comm c;
  EXPECT_EQ(c.size(), 1);
  at::Tensor t = torch::arange(4, torch::kFloat);
  c.all_reduce_sum(t);
  EXPECT_TRUE(torch::equal(t, torch::arange(4, torch::kFloat)));
  EXPECT_TRUE(torch::equal(c.all_gather(t), t));
}

TEST(Comm, AllReduceSumFp32Bf16Int64AndMax) {
  run_ranks(3, [](const Comm& c) {
    const double r = c.rank();
    at::Tensor f = torch::full({5}, r + 1, torch::kFloat);
    c.all_reduce_sum(f);
    EXPECT_TRUE(torch::equal(f, torch::full({5}, 6.0, torch::kFloat)));
    at::Tensor b = torch::full({3}, r + 0.5, torch::kBFloat16);  // 1.13 Gloo: reduced in fp32
    c.all_reduce_sum(b);
    EXPECT_EQ(b.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(b, torch::full({3}, 4.5, torch::kBFloat16)));
    at::Tensor i = torch::full({2}, c.rank() * 10, torch::kLong);
    c.all_reduce_sum(i);
    EXPECT_EQ(i[0].item<int64_t>(), 30);
    at::Tensor m = torch::full({1}, r, torch::kFloat);
    c.all_reduce_max(m);
    EXPECT_EQ(m.item<float>(), 2.0f);
  });
}

TEST(Comm, BroadcastGatherReduceScatter) {
  run_ranks(2, [](const Comm& c) {
    at::Tensor t = c.rank() == 1 ? torch::arange(6, torch::kFloat) : torch::zeros({6});
    c.broadcast(t, 1);
    EXPECT_TRUE(torch::equal(t, torch::arange(6, torch::kFloat)));
    at::Tensor g = c.all_gather(torch::full({2, 2}, c.rank(), torch::kFloat));
    ASSERT_EQ(g.sizes(), (std::vector<int64_t>{4, 2}));
    EXPECT_EQ(g[3][1].item<float>(), 1.0f);
    // 2-byte floats go as bytes over Gloo: shapes and values kept.
    for (const at::ScalarType type : {at::kBFloat16, at::kHalf}) {
      const at::Tensor mine =
          (torch::arange(12, torch::kFloat).view({2, 3, 2}) / 7 + c.rank()).to(type);
      const at::Tensor all = c.all_gather(mine);
      ASSERT_EQ(all.sizes(), (std::vector<int64_t>{4, 3, 2}));
      EXPECT_EQ(all.scalar_type(), type);
      EXPECT_TRUE(torch::equal(all.narrow(0, 2 * c.rank(), 2), mine));
      EXPECT_TRUE(torch::equal(
          all.narrow(0, 2 - 2 * c.rank(), 2),
          (torch::arange(12, torch::kFloat).view({2, 3, 2}) / 7 + 1 - c.rank()).to(type)));
    }
    // Each rank contributes [4, 3] = rank * 100 + index; rank r keeps rows 2r, 2r+1 summed.
    at::Tensor x = torch::arange(12, torch::kFloat).view({4, 3}) + 100.0 * c.rank();
    at::Tensor rs = c.reduce_scatter_sum(x);
    at::Tensor expect =
        (torch::arange(12, torch::kFloat).view({4, 3}) * 2 + 100).narrow(0, 2 * c.rank(), 2);
    EXPECT_TRUE(torch::equal(rs, expect)) << rs;
  });
}

// Receives match messages by tag, whether posted before the message came (b's, behind a's: a's
// is taken first) or after (the last), over Gloo and through a group's shared-memory rings.
TEST(Comm, PostedReceivesMatchByTag) {
  run_ranks(2, [](const Comm& world) {
    for (const bool messages : {false, true}) {
      const Comm c = messages ? world.subgroup({0, 1}, /*messages=*/true) : world;
      EXPECT_EQ(c.shared_memory_messages(), messages);
      if (c.rank() == 0) {
        at::Tensor a = torch::zeros({3}), b = torch::zeros({2, 2}, torch::kBFloat16);
        Pending pa = c.irecv(a, 1, 7);
        Pending pb = c.irecv(b, 1, 8);
        c.barrier();  // both posted before rank 1 sends
        pb.wait();
        EXPECT_TRUE(torch::equal(b, torch::full({2, 2}, 2.5, torch::kBFloat16)));
        pa.wait();
        EXPECT_TRUE(torch::equal(a, torch::arange(3, torch::kFloat)));
        at::Tensor late = torch::zeros({1});
        c.recv(late, 1, 9);  // sent before this receive was posted
        EXPECT_EQ(late.item<float>(), 9.0f);
      } else {
        c.barrier();
        Pending sa = c.send(torch::arange(3, torch::kFloat), 0, 7);
        Pending sb = c.send(torch::full({2, 2}, 2.5, torch::kBFloat16), 0, 8);
        Pending sl = c.send(torch::full({1}, 9.0), 0, 9);
        sb.wait();
        sl.wait();
        sa.wait();
      }
    }
  });
}

// A group made to carry messages sends them through shared memory, with Gloo's matching (also
// PostedReceivesMatchByTag): in order per (source, tag), in any order across tags; a message
// larger than its ring (4 MiB for two ranks) streams through it, and sends that do not fit wait
// in the group's sender thread while the sender goes on, even into a blocking collective that
// its receiver reaches before taking them.
TEST(Comm, MessagesThroughSharedMemoryMatchByTagInOrder) {
  run_ranks(2, [](const Comm& world) {
    const Comm c = world.subgroup({0, 1}, /*messages=*/true);
    EXPECT_TRUE(c.shared_memory_messages());
    EXPECT_FALSE(world.shared_memory_messages());
    auto payload = [](int64_t n, at::ScalarType type, int64_t seed) {
      return (torch::arange(n, torch::kDouble).remainder(1000 + seed) + seed).to(type);
    };
    if (c.rank() == 0) {
      c.barrier();  // rank 1 has sent everything below, most of it still queued
      at::Tensor x = torch::ones({1}, torch::kLong);
      c.all_reduce_sum(x);  // reached before any of it is taken
      EXPECT_EQ(x.item<int64_t>(), 2);
      // Same tag: in the order sent. Other tags: in any order the receiver likes.
      for (int64_t i = 0; i < 3; ++i) {
        at::Tensor t = torch::empty({5000}, torch::kInt);
        c.recv(t, 1, 20);
        EXPECT_TRUE(torch::equal(t, payload(5000, at::kInt, i))) << i;
      }
      at::Tensor big = torch::empty({3 << 20});  // 12 MiB: three rings' worth
      Pending pbig = c.irecv(big, 1, 30);
      for (int64_t k = 49; k >= 0; --k) {  // 50 x 300 KB, received last first
        at::Tensor t = torch::empty({75000});
        c.recv(t, 1, static_cast<int>(100 + k));
        EXPECT_TRUE(torch::equal(t, payload(75000, at::kFloat, k))) << k;
      }
      pbig.wait();
      EXPECT_TRUE(torch::equal(big, payload(3 << 20, at::kFloat, 3)));
      at::Tensor none = torch::empty({0}), h = torch::empty({4}, torch::kHalf);
      c.recv(none, 1, 40);
      c.recv(h, 1, 41);
      EXPECT_TRUE(torch::equal(h, payload(4, at::kHalf, 5)));
    } else {
      std::vector<Pending> sends;
      for (int64_t i = 0; i < 3; ++i) sends.push_back(c.send(payload(5000, at::kInt, i), 0, 20));
      sends.push_back(c.send(payload(3 << 20, at::kFloat, 3), 0, 30));
      for (int64_t k = 0; k < 50; ++k)
        sends.push_back(c.send(payload(75000, at::kFloat, k), 0, static_cast<int>(100 + k)));
      sends.push_back(c.send(torch::empty({0}), 0, 40));
      sends.push_back(c.send(payload(4, at::kHalf, 5), 0, 41));
      c.barrier();
      at::Tensor x = torch::ones({1}, torch::kLong);
      c.all_reduce_sum(x);
      for (Pending& p : sends) p.wait();
    }
  });
}

// Three ranks, every one sending to both others at once: each ordered pair has its own ring.
TEST(Comm, MessagesThroughSharedMemoryBetweenEveryPair) {
  run_ranks(3, [](const Comm& world) {
    const Comm c = world.subgroup({0, 1, 2}, /*messages=*/true);
    ASSERT_TRUE(c.shared_memory_messages());
    std::vector<Pending> sends;
    for (int round = 0; round < 20; ++round) {
      for (int q = 0; q < 3; ++q)
        if (q != c.rank())
          sends.push_back(c.send(torch::full({20000 * (round % 3 + 1)},
                                             static_cast<float>(c.rank() * 100 + q + round)),
                                 q, round));
      for (int q = 0; q < 3; ++q) {
        if (q == c.rank()) continue;
        at::Tensor t = torch::empty({20000 * (round % 3 + 1)});
        c.recv(t, q, round);
        EXPECT_TRUE(
            torch::equal(t, torch::full_like(t, static_cast<float>(q * 100 + c.rank() + round))));
      }
    }
    for (Pending& p : sends) p.wait();
  });
}

// A receive that nothing arrives for ends with an error naming the peer and tag when the group's
// timeout passes; a message of another size than its receive is an error naming both; a send
// larger than its ring whose receiver takes none of it fails when the timeout passes; later
// messages on either failed ring fail at once with the first cause.
TEST(Comm, MessagesThroughSharedMemoryFailClearly) {
  static std::atomic<int> groups{0};
  const std::string key = "messages_fail_" + std::to_string(groups++);
  std::vector<std::string> errors(5);
  std::vector<std::thread> threads;
  std::atomic<bool> timed_out{false}, sent{false};
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      const Comm c =
          Comm::in_memory(key, r, 2, std::chrono::milliseconds(2000)).subgroup({0, 1}, true);
      if (r == 0) {
        at::Tensor t = torch::empty({4});
        errors[0] = error_of([&] { c.recv(t, 1, 5); });
        timed_out = true;
        errors[1] = error_of([&] { c.recv(t, 1, 6); });  // rank 1 sends 5 floats
        // The ring from rank 1 is out of step since.
        errors[3] = error_of([&] { c.recv(t, 1, 8); });
        while (!sent) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      } else {
        while (!timed_out) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        c.send(torch::ones({5}), 0, 6).wait();
        // 8 MiB, twice the ring: never taken.
        errors[2] = error_of([&] { c.send(torch::ones({2 << 20}), 0, 7).wait(); });
        // Part of it is in the ring.
        errors[4] = error_of([&] { c.send(torch::ones({1}), 0, 8).wait(); });
        sent = true;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_NE(errors[2].find("rank 1 of 2: send to rank 0 with tag 7 failed: the receiver took none "
                           "of it within 2 s"),
            std::string::npos)
      << errors[2];
  // Later messages on a failed ring fail with the first cause.
  EXPECT_NE(errors[3].find("recv from rank 1 with tag 8 failed: an earlier message from it "
                           "failed: rank 0 of 2: a message of 20 bytes"),
            std::string::npos)
      << errors[3];
  EXPECT_NE(errors[4].find("send to rank 0 with tag 8 refused: an earlier send to it failed: rank "
                           "1 of 2: send to rank 0 with tag 7 failed"),
            std::string::npos)
      << errors[4];
  EXPECT_NE(errors[0].find("recv from rank 1 with tag 5 failed: it did not arrive within 2 s"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("a message of 20 bytes from rank 1 with tag 6 arrived for a receive of "
                           "16 bytes"),
            std::string::npos)
      << errors[1];
}

// Uneven all-to-all in every dtype the runtime sends (bf16 activations of MoE dispatch, int64
// counts, fp32), 1-D and 3-D, with a rank that sends nothing to one peer. bf16 failed on 1.13's
// Gloo ("Invalid scalar type") before it went as bytes.
TEST(Comm, AllToAllUnevenInEveryDtype) {
  run_ranks(3, [](const Comm& c) {
    const int64_t r = c.rank();
    // Rank r sends (r + d) % 3 rows to rank d, each row filled with 100 r + d.
    std::vector<int64_t> send(3), recv(3);
    for (int64_t d = 0; d < 3; ++d) send[d] = (r + d) % 3, recv[d] = (d + r) % 3;
    for (at::ScalarType dtype : {torch::kBFloat16, torch::kLong, torch::kFloat}) {
      for (const std::vector<int64_t>& row : {std::vector<int64_t>{}, std::vector<int64_t>{2, 3}}) {
        std::vector<at::Tensor> parts, want;
        for (int64_t d = 0; d < 3; ++d) {
          std::vector<int64_t> shape = {send[d]};
          shape.insert(shape.end(), row.begin(), row.end());
          parts.push_back(torch::full(shape, 100 * r + d, dtype));
          std::vector<int64_t> from = {recv[d]};
          from.insert(from.end(), row.begin(), row.end());
          want.push_back(torch::full(from, 100 * d + r, dtype));
        }
        const at::Tensor got = c.all_to_all(torch::cat(parts), send, recv);
        EXPECT_EQ(got.scalar_type(), dtype);
        EXPECT_TRUE(torch::equal(got, torch::cat(want))) << "rank " << r << " " << dtype;
      }
    }
  });
}

TEST(Comm, SubgroupsReduceOnlyTheirMembers) {
  run_ranks(4, [](const Comm& c) {
    Comm evens = c.subgroup({0, 2});
    Comm odds = c.subgroup({1, 3});
    const Comm& mine = c.rank() % 2 == 0 ? evens : odds;
    EXPECT_EQ(mine.size(), 2);
    EXPECT_EQ(mine.rank(), c.rank() / 2);
    at::Tensor t = torch::full({1}, c.rank(), torch::kFloat);
    mine.all_reduce_sum(t);
    EXPECT_EQ(t.item<float>(), c.rank() % 2 == 0 ? 2.0f : 4.0f);
    EXPECT_EQ((c.rank() % 2 == 0 ? odds : evens).size(), 1);  // non-members: trivial group
  });
}

TEST(Comm, WorldFromEnvironment) {
  ::setenv("RANK", "3", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("MASTER_PORT", "12345", 1);
  WorldInfo w = world_from_env();
  EXPECT_EQ(w.rank, 3);
  EXPECT_EQ(w.world_size, 4);
  EXPECT_EQ(w.local_rank, 3);
  EXPECT_EQ(w.master_port, 12345);
  ::setenv("RANK", "x", 1);
  try {
    world_from_env();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='x'"), std::string::npos) << e.what();
  }
  ::setenv("RANK", "4", 1);
  EXPECT_THROW(world_from_env(), Error);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_PORT"}) ::unsetenv(v);
  ::setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  ::setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  w = world_from_env();
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.world_size, 2);
  ::unsetenv("OMPI_COMM_WORLD_RANK");
  ::unsetenv("OMPI_COMM_WORLD_SIZE");
}

// Sequence parallelism's two collectives, against one process: a column-parallel linear of the
// all-gathered sequence (which keeps only its shard for backward) and a row-parallel linear
// whose output is reduce-scattered back over the sequence. The outputs, and the gradients of the
// input, of both weights and of the bias, are this rank's parts of the single-process ones.
TEST(Comm, SequenceParallelLinearsMatchOneProcess) {
  const int64_t B = 2, S = 6, H = 4, F = 8;
  torch::manual_seed(3);
  const at::Tensor x0 = torch::randn({B, S, H}, torch::kDouble);
  const at::Tensor w10 = torch::randn({F, H}, torch::kDouble);
  const at::Tensor b10 = torch::randn({F}, torch::kDouble);
  const at::Tensor w20 = torch::randn({H, F}, torch::kDouble);
  const at::Tensor c = torch::randn({B, S, H}, torch::kDouble);
  auto leaf = [](const at::Tensor& t) { return t.clone().set_requires_grad(true); };
  at::Tensor x = leaf(x0), w1 = leaf(w10), b1 = leaf(b10), w2 = leaf(w20);
  const at::Tensor y = at::linear(at::linear(x, w1, b1).tanh(), w2);
  (y * c).sum().backward();
  run_ranks(2, [&](const Comm& g) {
    const int64_t r = g.rank(), s = S / 2, f = F / 2;
    at::Tensor xr = leaf(x0.narrow(1, r * s, s)), w1r = leaf(w10.narrow(0, r * f, f));
    at::Tensor b1r = leaf(b10.narrow(0, r * f, f)), w2r = leaf(w20.narrow(1, r * f, f));
    const at::Tensor hidden = column_linear(xr, w1r, b1r, g, 1);  // every position, F/2
    ASSERT_EQ(hidden.sizes(), (std::vector<int64_t>{B, S, f}));
    const at::Tensor yr = scatter_along(at::linear(hidden.tanh(), w2r), g, 1);
    ASSERT_EQ(yr.sizes(), (std::vector<int64_t>{B, s, H}));
    EXPECT_TRUE(torch::allclose(yr, y.detach().narrow(1, r * s, s)));
    (yr * c.narrow(1, r * s, s)).sum().backward();
    EXPECT_TRUE(torch::allclose(xr.grad(), x.grad().narrow(1, r * s, s)));
    EXPECT_TRUE(torch::allclose(w1r.grad(), w1.grad().narrow(0, r * f, f)));
    EXPECT_TRUE(torch::allclose(b1r.grad(), b1.grad().narrow(0, r * f, f)));
    EXPECT_TRUE(torch::allclose(w2r.grad(), w2.grad().narrow(1, r * f, f)));
  });
}

// The same in bf16 (Gloo moves bf16 as fp32: the reduce-scatter sums in fp32), with the first
// linear's weight frozen (its backward then gathers nothing again): against one process in
// double on the same bf16 values.
TEST(Comm, SequenceParallelLinearsInBf16WithAFrozenWeight) {
  const int64_t B = 2, S = 8, H = 16, F = 32;
  torch::manual_seed(5);
  auto bf16 = [](const at::Tensor& t) { return t.to(torch::kBFloat16); };
  const at::Tensor x0 = bf16(torch::randn({B, S, H})), w10 = bf16(torch::randn({F, H}));
  const at::Tensor w20 = bf16(torch::randn({H, F})), c = bf16(torch::randn({B, S, H}));
  auto leaf = [](const at::Tensor& t) { return t.clone().set_requires_grad(true); };
  at::Tensor x = leaf(x0.to(torch::kDouble)), w2 = leaf(w20.to(torch::kDouble));
  const at::Tensor y = at::linear(at::linear(x, w10.to(torch::kDouble)).tanh(), w2);
  (y * c.to(torch::kDouble)).sum().backward();
  const auto close = [](const at::Tensor& got, const at::Tensor& want) {
    const double err = (got.to(torch::kDouble) - want).abs().max().item<double>();
    return err <= 3e-2 * want.abs().max().item<double>();
  };
  run_ranks(2, [&](const Comm& g) {
    const int64_t r = g.rank(), s = S / 2, f = F / 2;
    at::Tensor xr = leaf(x0.narrow(1, r * s, s)), w2r = leaf(w20.narrow(1, r * f, f));
    const at::Tensor w1r = w10.narrow(0, r * f, f);  // frozen
    const at::Tensor hidden = column_linear(xr, w1r, at::Tensor(), g, 1);
    const at::Tensor yr = scatter_along(at::linear(hidden.tanh(), w2r), g, 1);
    ASSERT_EQ(yr.scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(close(yr, y.detach().narrow(1, r * s, s)));
    (yr * c.narrow(1, r * s, s)).sum().backward();
    EXPECT_TRUE(close(xr.grad(), x.grad().narrow(1, r * s, s)));
    EXPECT_TRUE(close(w2r.grad(), w2.grad().narrow(1, r * f, f)));
  });
}

// A column-parallel linear without SP (x replicated, its gradient all-reduced) then a row-parallel
// one, against one process; and the overlapped backward (collectives waited only where their
// results are needed, dist::set_overlap_tp_comm) gives bit for bit the gradients of the one that
// waits for each collective where it is issued, with and without SP, in bf16 (whose all-reduce
// goes through an fp32 copy, copied back at the wait).
TEST(Comm, ColumnParallelLinearOverlapChangesNoBit) {
  const int64_t B = 2, S = 8, H = 16, F = 32;
  torch::manual_seed(7);
  const at::Tensor x0 = torch::randn({B, S, H}, torch::kDouble);
  const at::Tensor w10 = torch::randn({F, H}, torch::kDouble),
                   b10 = torch::randn({F}, torch::kDouble);
  const at::Tensor w20 = torch::randn({H, F}, torch::kDouble),
                   c = torch::randn({B, S, H}, torch::kDouble);
  auto leaf = [](const at::Tensor& t) { return t.clone().set_requires_grad(true); };
  at::Tensor x = leaf(x0), w1 = leaf(w10), b1 = leaf(b10), w2 = leaf(w20);
  (at::linear(at::linear(x, w1, b1).tanh(), w2) * c).sum().backward();
  run_ranks(2, [&](const Comm& g) {
    const int64_t r = g.rank(), f = F / 2;
    at::Tensor xr = leaf(x0), w1r = leaf(w10.narrow(0, r * f, f));
    at::Tensor b1r = leaf(b10.narrow(0, r * f, f)), w2r = leaf(w20.narrow(1, r * f, f));
    const at::Tensor y = reduce_from(at::linear(column_linear(xr, w1r, b1r, g).tanh(), w2r), g);
    (y * c).sum().backward();
    EXPECT_TRUE(torch::allclose(xr.grad(), x.grad()));
    EXPECT_TRUE(torch::allclose(w1r.grad(), w1.grad().narrow(0, r * f, f)));
    EXPECT_TRUE(torch::allclose(b1r.grad(), b1.grad().narrow(0, r * f, f)));
    EXPECT_TRUE(torch::allclose(w2r.grad(), w2.grad().narrow(1, r * f, f)));
  });
  auto bf16 = [](const at::Tensor& t) { return t.to(torch::kBFloat16); };
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sp" : "tp");
    std::vector<at::Tensor> grads[2];  // [overlap] x rank x {x, w1, b1, w2}
    for (bool overlap : {true, false}) {
      set_overlap_tp_comm(overlap);
      std::mutex mu;
      std::vector<at::Tensor> got(8);
      run_ranks(2, [&](const Comm& g) {
        const int64_t r = g.rank(), s = S / 2, f = F / 2;
        at::Tensor xr = leaf(bf16(sp ? x0.narrow(1, r * s, s) : x0));
        at::Tensor w1r = leaf(bf16(w10.narrow(0, r * f, f))),
                   b1r = leaf(bf16(b10.narrow(0, r * f, f)));
        at::Tensor w2r = leaf(bf16(w20.narrow(1, r * f, f)));
        const at::Tensor h = column_linear(xr, w1r, b1r, g, sp ? 1 : -1).tanh();
        const at::Tensor partial = at::linear(h, w2r);
        const at::Tensor y = sp ? scatter_along(partial, g, 1) : reduce_from(partial, g);
        (y.to(torch::kDouble) * (sp ? c.narrow(1, r * s, s) : c)).sum().backward();
        std::lock_guard<std::mutex> lock(mu);
        for (int k = 0; k < 4; ++k)
          got[4 * r + k] = std::vector<at::Tensor>{xr, w1r, b1r, w2r}[k].grad();
      });
      grads[overlap] = got;
    }
    set_overlap_tp_comm(true);
    for (size_t k = 0; k < 8; ++k) {
      ASSERT_TRUE(grads[0][k].defined() && grads[1][k].defined()) << k;
      EXPECT_TRUE(torch::equal(grads[0][k], grads[1][k])) << "gradient " << k;
    }
  }
}

// Collectives in flight side by side, waited in the reverse order of their start: each gets its
// own result (Gloo pairs them by their order of issue on every rank).
TEST(Comm, AsyncCollectivesInFlightTogether) {
  run_ranks(2, [&](const Comm& g) {
    const double r = g.rank();
    at::Tensor a = torch::full({4, 3}, r + 1);
    PendingTensor gathered = g.all_gather_async(torch::full({2, 3}, 10 * (r + 1)));
    PendingTensor scattered =
        g.reduce_scatter_sum_async(torch::arange(12.0).view({4, 3}) * (r + 1));
    Pending reduced = g.all_reduce_sum_async(a);
    reduced.wait();
    EXPECT_TRUE(torch::equal(a, torch::full({4, 3}, 3.0)));
    const at::Tensor sc = scattered.wait();
    EXPECT_TRUE(torch::equal(sc, torch::arange(12.0).view({4, 3}).narrow(0, 2 * g.rank(), 2) * 3));
    const at::Tensor ga = gathered.wait();
    EXPECT_TRUE(
        torch::equal(ga, torch::cat({torch::full({2, 3}, 10.0), torch::full({2, 3}, 20.0)})));
    EXPECT_TRUE(torch::equal(gathered.wait(), ga));  // waited again: the same result
  });
}

// The blocking CPU collectives through shared memory (dist/shm.h) give what Gloo gives, for
// every dtype, on tensors of several slots (a slot of a 3-rank group is about 1.3 MiB), with
// Gloo's async variants in flight beside them; subgroups get their own slots.
TEST(Comm, SharedMemoryCollectivesMatchGloo) {
  std::mutex mu;
  std::map<std::pair<int, bool>, std::vector<at::Tensor>> results;  // (rank, shared memory)
  for (const bool shared : {true, false}) {
    run_ranks(
        3,
        [&](const Comm& c) {
          EXPECT_EQ(c.shared_memory(), shared);
          const int r = c.rank();
          auto data = [&](int64_t n, at::ScalarType type) {
            at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(7 + r + n));
            at::Tensor x = at::randn({n}, gen);
            return type == at::kLong ? (x * 1000).to(type) : x.to(type);
          };
          std::vector<at::Tensor> out;
          at::Tensor in_flight = torch::full({1000}, r + 1.0);
          Pending pending = c.all_reduce_sum_async(in_flight);  // Gloo, beside the blocking ones
          for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong}) {
            for (const int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1} << 20}) {
              at::Tensor t = data(n, type);
              c.all_reduce_sum(t);
              out.push_back(t);
              at::Tensor m = data(n, type == at::kLong ? at::kLong : at::kFloat);  // Gloo's
              c.all_reduce_max(m);
              out.push_back(m);
              out.push_back(c.all_gather(data(n, type).view({n, 1})));
              out.push_back(c.reduce_scatter_sum(data(3 * n, type).view({3, n})));
            }
          }
          pending.wait();
          EXPECT_TRUE(torch::equal(in_flight, torch::full({1000}, 6.0)));
          Comm pair = c.subgroup({0, 2});
          if (r != 1) {
            EXPECT_EQ(pair.shared_memory(), shared);
            at::Tensor t = torch::full({5}, r + 1.0);
            pair.all_reduce_sum(t);
            EXPECT_TRUE(torch::equal(t, torch::full({5}, 4.0)));
          }
          std::lock_guard<std::mutex> lock(mu);
          results[{r, shared}] = out;
        },
        shared);
  }
  for (int r = 0; r < 3; ++r) {
    const auto& a = results.at({r, true});
    const auto& b = results.at({r, false});
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].sizes(), b[i].sizes()) << "result " << i;
      EXPECT_EQ(a[i].scalar_type(), b[i].scalar_type()) << "result " << i;
      // Gloo's ring sums three ranks' floats in another order than rank order: the sums agree
      // to rounding; everything else bit for bit.
      if (i % 4 == 0 && a[i].is_floating_point())
        EXPECT_TRUE(torch::allclose(a[i].to(at::kFloat), b[i].to(at::kFloat), 1e-5, 1e-5))
            << "result " << i << " of rank " << r;
      else
        EXPECT_TRUE(torch::equal(a[i], b[i])) << "result " << i << " of rank " << r;
    }
    // Every rank holds the same sums and maxima (identical bits, as TP's replicas need).
    for (size_t i = 0; i < a.size(); i += 4) {
      EXPECT_TRUE(torch::equal(a[i], results.at({0, true})[i]));
      EXPECT_TRUE(torch::equal(a[i + 1], results.at({0, true})[i + 1]));
    }
  }
}

// Two ranks: the sums through shared memory equal Gloo's bit for bit (a + b is b + a; 2-byte
// floats summed in fp32 and rounded to nearest even once, as LibTorch rounds), sums that
// overflow bf16 included.
TEST(Comm, SharedMemorySumsOfTwoRanksAreGloosBitForBit) {
  std::vector<at::Tensor> got[2];
  for (const bool shared : {true, false})
    run_ranks(
        2,
        [&](const Comm& c) {
          at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(11 + c.rank()));
          at::Tensor x =
              at::randn({3, 70001}, gen) * at::pow(10.0, at::randint(-30, 39, {3, 70001}, gen));
          for (const at::ScalarType type : {at::kFloat, at::kBFloat16, at::kHalf}) {
            at::Tensor t = x.to(type);
            c.all_reduce_sum(t);
            if (c.rank() == 0) got[shared ? 0 : 1].push_back(t);
          }
        },
        shared);
  ASSERT_EQ(got[0].size(), got[1].size());
  for (size_t i = 0; i < got[0].size(); ++i) {
    EXPECT_GT(got[0][i].isinf().sum().item<int64_t>() + (i == 0), 0) << "no overflow in " << i;
    EXPECT_TRUE(torch::equal(got[0][i].isnan(), got[1][i].isnan())) << i;
    EXPECT_TRUE(torch::equal(got[0][i].nan_to_num(0), got[1][i].nan_to_num(0))) << i;
  }
}

// Ranks that call a group's collectives out of step (another collective, or another size, in
// the same place) get an error naming the mismatch rather than each other's bytes.
TEST(Comm, SharedMemoryCollectivesOutOfStepAreAnError) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](const Comm& c) {
    at::Tensor t = torch::ones({c.rank() == 0 ? 4 : 5});
    try {
      c.all_reduce_sum(t);
      ADD_FAILURE() << "rank " << c.rank() << ": no error";
    } catch (const weft::Error& e) {
      errors[static_cast<size_t>(c.rank())] = e.what();
    }
    at::Tensor u = torch::ones({4});
    EXPECT_THROW(c.all_reduce_sum(u), weft::Error);  // the group stays failed
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("another size, in the same place"), std::string::npos) << e;
}

}  // namespace
}  // namespace weft::dist
