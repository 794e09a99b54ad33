#include "weft/dist/messages.h"

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <cstring>

#include "weft/core/error.h"

namespace weft::dist {

namespace {
using Clock = std::chrono::steady_clock;

// A message's first bytes on its ring.
struct Header {
  int32_t tag;
  uint32_t mark;  // kMark: a header without it means the ring is out of step (a defect)
  uint64_t bytes;
};
static_assert(sizeof(Header) == 16, "message headers are 16 bytes");
constexpr uint32_t kMark = 0x6d746677;  // "wftm"

// The sender thread's longest sleep on one ring while sends to several wait.
constexpr std::chrono::milliseconds kSenderSlice{5};
}  // namespace

struct SharedMessages::Outgoing {
  at::Tensor t;
  Header header{};
  size_t done = 0;             // bytes of header and payload in the ring
  Clock::time_point progress;  // when bytes last went in
  bool finished = false;
  std::string error;  // set when it never will
};

struct SharedMessages::Incoming {
  at::Tensor into;    // where the payload goes: the receive's tensor, or a buffer set aside
  at::Tensor posted;  // the receive's tensor when `into` is a buffer set aside (copied at wait)
  size_t bytes = 0, got = 0;
  bool complete = false;
};

struct SharedMessages::Source {
  Header header{};
  size_t header_got = 0;
  std::shared_ptr<Incoming> current;  // the message whose payload is being read
};

SharedMessages::SharedMessages(SharedSlots& rings, std::chrono::milliseconds timeout)
    : rings_(rings),
      timeout_(timeout),
      rank_(rings.rank()),
      size_(rings.size()),
      queued_(static_cast<size_t>(rings.size())),
      send_failed_(static_cast<size_t>(rings.size())),
      sources_(static_cast<size_t>(rings.size())),
      recv_failed_(static_cast<size_t>(rings.size())) {
  WEFT_ASSERT(rings.ring_bytes() > 0, "SharedMessages: the group has no rings");
}

SharedMessages::~SharedMessages() {
  {
    std::lock_guard<std::mutex> lock(out_mu_);
    stopping_ = true;
  }
  out_cv_.notify_all();
  if (sender_.joinable()) sender_.join();
}

bool SharedMessages::put(int dst, Outgoing& m) {
  const size_t total = sizeof(Header) + static_cast<size_t>(m.header.bytes);
  const char* payload = static_cast<const char*>(m.t.data_ptr());
  while (m.done < total) {
    const bool head = m.done < sizeof(Header);
    const char* from = head ? reinterpret_cast<const char*>(&m.header) + m.done
                            : payload + (m.done - sizeof(Header));
    const size_t k = rings_.ring_put(dst, from, head ? sizeof(Header) - m.done : total - m.done);
    if (k == 0) return false;
    m.done += k;
  }
  return true;
}

Pending SharedMessages::send(const at::Tensor& t, int dst, int tag) {
  WEFT_ASSERT(t.is_cpu() && t.is_contiguous(), "SharedMessages::send: not a contiguous CPU tensor");
  RECORD_FUNCTION("weft::shm send", std::vector<c10::IValue>({t}));
  auto m = std::make_shared<Outgoing>();
  m->t = t;
  m->header = {tag, kMark, static_cast<uint64_t>(t.nbytes())};
  std::lock_guard<std::mutex> lock(out_mu_);
  const std::string& failed = send_failed_[static_cast<size_t>(dst)];
  WEFT_CHECK(failed.empty(), "rank ", rank_, " of ", size_, ": send to rank ", dst, " with tag ",
             tag, " refused: an earlier send to it failed: ", failed);
  std::deque<std::shared_ptr<Outgoing>>& q = queued_[static_cast<size_t>(dst)];
  while (!q.empty() && put(dst, *q.front())) {  // room freed since: the sender thread's work
    q.front()->finished = true;
    q.pop_front();
    done_cv_.notify_all();
  }
  if (q.empty() && put(dst, *m)) return Pending();
  m->progress = Clock::now();
  q.push_back(m);
  if (!sender_.joinable()) sender_ = std::thread([this] { sender_loop(); });
  out_cv_.notify_all();
  return Pending([this, m] {
    std::unique_lock<std::mutex> lock(out_mu_);
    done_cv_.wait(lock, [&] { return m->finished; });
    WEFT_CHECK(m->error.empty(), m->error);
  });
}

void SharedMessages::sender_loop() {
  std::unique_lock<std::mutex> lock(out_mu_);
  const auto fail = [&](size_t dst, const std::string& why) {
    send_failed_[dst] = why;
    for (const std::shared_ptr<Outgoing>& m : queued_[dst]) m->finished = true, m->error = why;
    queued_[dst].clear();
    done_cv_.notify_all();
  };
  Clock::time_point next_check = Clock::now() + SharedSlots::kCheckEvery;
  for (;;) {
    out_cv_.wait(lock, [&] {
      if (stopping_) return true;
      for (const auto& q : queued_)
        if (!q.empty()) return true;
      return false;
    });
    if (stopping_) {
      for (size_t dst = 0; dst < queued_.size(); ++dst)
        if (!queued_[dst].empty())
          fail(dst, detail::str_cat("rank ", rank_, " of ", size_, ": send to rank ", dst,
                                    " with tag ", queued_[dst].front()->header.tag,
                                    " failed: its group was closed before the receiver took it"));
      return;
    }
    const Clock::time_point now = Clock::now();
    const bool check = now >= next_check;
    if (check) next_check = now + SharedSlots::kCheckEvery;
    int waiting = -1, blocked = 0;
    for (int dst = 0; dst < size_; ++dst) {
      std::deque<std::shared_ptr<Outgoing>>& q = queued_[static_cast<size_t>(dst)];
      while (!q.empty()) {
        Outgoing& m = *q.front();
        const size_t before = m.done;
        const bool all = put(dst, m);
        if (m.done != before) m.progress = now;
        if (!all) break;
        m.finished = true;
        q.pop_front();
        done_cv_.notify_all();
      }
      if (q.empty()) continue;
      const std::string exited = check ? rings_.exited_rank(dst) : "";
      if (!exited.empty() || now - q.front()->progress > timeout_) {
        const std::string why = exited.empty()
                                    ? detail::str_cat("the receiver took none of it within ",
                                                      timeout_.count() / 1000.0, " s")
                                    : exited;
        fail(static_cast<size_t>(dst),
             detail::str_cat("rank ", rank_, " of ", size_, ": send to rank ", dst, " with tag ",
                             q.front()->header.tag, " failed: ", why, " (shared-memory messages)"));
        continue;
      }
      if (waiting < 0) waiting = dst;
      ++blocked;
    }
    if (waiting < 0) continue;
    lock.unlock();
    try {
      const auto slice = blocked > 1 ? kSenderSlice : SharedSlots::kCheckEvery;
      rings_.ring_wait(waiting, /*space=*/true, 1, Clock::now() + slice, "send");
    } catch (const weft::Error&) {
      // The peer exited: the check at the top of the next round fails its sends.
      next_check = Clock::now();
    }
    lock.lock();
  }
}

Pending SharedMessages::irecv(const at::Tensor& t, int src, int tag) {
  WEFT_ASSERT(t.is_cpu() && t.is_contiguous(),
              "SharedMessages::irecv: not a contiguous CPU tensor");
  auto in = std::make_shared<Incoming>();
  {
    std::lock_guard<std::mutex> lock(in_mu_);
    auto u = unexpected_.find({src, tag});
    if (u != unexpected_.end()) {  // it came before this receive
      in = u->second.front();
      u->second.pop_front();
      if (u->second.empty()) unexpected_.erase(u);
      WEFT_CHECK(in->bytes == t.nbytes(), "rank ", rank_, " of ", size_, ": a message of ",
                 in->bytes, " bytes from rank ", src, " with tag ", tag,
                 " arrived for a receive of ", t.nbytes(),
                 " bytes (the ranks disagree on its shape or dtype)");
      in->posted = t;
    } else {
      in->into = t;
      in->bytes = t.nbytes();
      posted_[{src, tag}].push_back(in);
    }
  }
  return Pending([this, in, src, tag] { wait_received(in, src, tag); });
}

void SharedMessages::take(int src) {
  Source& s = sources_[static_cast<size_t>(src)];
  for (;;) {
    if (!s.current) {
      s.header_got += rings_.ring_get(src, reinterpret_cast<char*>(&s.header) + s.header_got,
                                      sizeof(Header) - s.header_got);
      if (s.header_got < sizeof(Header)) return;
      s.header_got = 0;
      WEFT_CHECK(s.header.mark == kMark, "rank ", rank_, " of ", size_,
                 ": the message ring from rank ", src,
                 " is out of step (a header without its mark)");
      const int tag = s.header.tag;
      const size_t bytes = static_cast<size_t>(s.header.bytes);
      auto p = posted_.find({src, tag});
      if (p != posted_.end()) {
        s.current = p->second.front();
        p->second.pop_front();
        if (p->second.empty()) posted_.erase(p);
        WEFT_CHECK(s.current->bytes == bytes, "rank ", rank_, " of ", size_, ": a message of ",
                   bytes, " bytes from rank ", src, " with tag ", tag, " arrived for a receive of ",
                   s.current->bytes, " bytes (the ranks disagree on its shape or dtype)");
      } else {  // no receive for it yet: set aside
        s.current = std::make_shared<Incoming>();
        s.current->bytes = bytes;
        s.current->into = at::empty({static_cast<int64_t>(bytes)}, at::kByte);
        unexpected_[{src, tag}].push_back(s.current);
      }
    }
    Incoming& in = *s.current;
    if (in.got < in.bytes) {
      in.got +=
          rings_.ring_get(src, static_cast<char*>(in.into.data_ptr()) + in.got, in.bytes - in.got);
      if (in.got < in.bytes) return;
    }
    in.complete = true;
    s.current.reset();
  }
}

void SharedMessages::wait_received(const std::shared_ptr<Incoming>& in, int src, int tag) {
  RECORD_FUNCTION("weft::shm recv", std::vector<c10::IValue>());
  const Clock::time_point deadline = Clock::now() + timeout_;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(in_mu_);
      std::string& failed = recv_failed_[static_cast<size_t>(src)];
      WEFT_CHECK(failed.empty(), "rank ", rank_, " of ", size_, ": recv from rank ", src,
                 " with tag ", tag, " failed: an earlier message from it failed: ", failed);
      try {
        take(src);
      } catch (const weft::Error& e) {
        failed = e.what();
        throw;
      }
      if (in->complete) {
        if (in->posted.defined() && in->bytes > 0)
          std::memcpy(in->posted.data_ptr(), in->into.data_ptr(), in->bytes);
        return;
      }
    }
    if (!rings_.ring_wait(src, /*space=*/false, 1, deadline, "recv"))
      WEFT_FAIL("rank ", rank_, " of ", size_, ": recv from rank ", src, " with tag ", tag,
                " failed: it did not arrive within ", timeout_.count() / 1000.0,
                " s (shared-memory messages: the peer hung, or sent other tags)");
  }
}

}  // namespace weft::dist
