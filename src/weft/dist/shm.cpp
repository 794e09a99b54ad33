#include "weft/dist/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <random>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "weft/core/error.h"

namespace weft::dist {

namespace {

constexpr uint64_t kMagic = 0x77656674736c6f74ULL;  // "weftslot"
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;
// A waiting rank spins this long before it sleeps on the futex: a peer a few microseconds
// behind costs no system call, a peer without a core does not lose its time to the spinner.
constexpr std::chrono::microseconds kSpin{20};

static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                  std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory collectives need lock-free atomics (they live in shared memory)");

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

uint64_t pid_namespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

// Whether process `pid` (of this PID namespace) has exited: gone, or a zombie its parent has
// not reaped yet.
bool exited(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;
  std::string line;
  std::getline(f, line);
  const size_t paren = line.rfind(')');  // the command name may hold spaces and parentheses
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

std::string errno_text(int err) { return std::strerror(err); }

float bf16_to_float(uint16_t u) {
  const uint32_t bits = static_cast<uint32_t>(u) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint16_t float_to_bf16(float f) {  // round to nearest even; any NaN becomes the quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// A block at a time into an accumulator, so that each loop is one the vectoriser takes.
template <typename T, typename Acc, typename Load, typename Store>
void sum_blocks(T* dst, const char* const* slots, int size, size_t offset, int64_t len, Load load,
                Store store) {
  constexpr int64_t kBlock = 512;
  Acc acc[kBlock];
  for (int64_t i = 0; i < len; i += kBlock) {
    const int64_t n = std::min(kBlock, len - i);
    const T* first = reinterpret_cast<const T*>(slots[0] + offset) + i;
    for (int64_t j = 0; j < n; ++j) acc[j] = load(first[j]);
    for (int q = 1; q < size; ++q) {
      const T* p = reinterpret_cast<const T*>(slots[q] + offset) + i;
      for (int64_t j = 0; j < n; ++j) acc[j] += load(p[j]);
    }
    for (int64_t j = 0; j < n; ++j) dst[i + j] = store(acc[j]);
  }
}

}  // namespace

void sum_slots(SlotType type, void* dst, const char* const* slots, int size, size_t offset,
               int64_t len) {
  const auto same = [](auto x) { return x; };
  switch (type) {
    case SlotType::kFloat:
      return sum_blocks<float, float>(static_cast<float*>(dst), slots, size, offset, len, same,
                                      same);
    case SlotType::kDouble:
      return sum_blocks<double, double>(static_cast<double*>(dst), slots, size, offset, len, same,
                                        same);
    case SlotType::kBFloat16:
      return sum_blocks<uint16_t, float>(static_cast<uint16_t*>(dst), slots, size, offset, len,
                                         bf16_to_float, float_to_bf16);
  }
}

struct SharedSlots::Header {
  uint64_t magic;
  uint64_t nonce;
  uint64_t size;
  uint64_t slot_bytes;
  uint64_t ring_bytes;
  alignas(kLine) std::atomic<uint32_t> epoch;  // the futex word: bumped by every arrival
  std::atomic<uint32_t> waiters;               // ranks asleep (or about to be) on it
};

namespace {
// One cache line per rank: what it publishes, apart from the others' lines.
struct alignas(kLine) RankLine {
  std::atomic<uint64_t> arrived;
  int64_t pid;
  uint64_t pid_namespace;
  uint64_t what[2];  // per slot set: the exchange's `what` (checked equal on every rank)
};

size_t lines_offset() { return (sizeof(SharedSlots::Header) + kLine - 1) / kLine * kLine; }
size_t data_offset(int size) {
  return (lines_offset() + static_cast<size_t>(size) * sizeof(RankLine) + kPage - 1) / kPage *
         kPage;
}
size_t rings_count(int size) { return static_cast<size_t>(size) * static_cast<size_t>(size - 1); }
size_t ring_heads_offset(int size, size_t slot_bytes) {
  return (data_offset(size) + 2 * static_cast<size_t>(size) * slot_bytes + kPage - 1) / kPage *
         kPage;
}
size_t ring_data_offset(int size, size_t slot_bytes) {
  const size_t heads = rings_count(size) * 2 * kLine;  // sizeof(SharedSlots::Ring)
  return ring_heads_offset(size, slot_bytes) + (heads + kPage - 1) / kPage * kPage;
}
size_t segment_bytes(int size, size_t slot_bytes, size_t ring_bytes) {
  if (ring_bytes == 0) return data_offset(size) + 2 * static_cast<size_t>(size) * slot_bytes;
  return ring_data_offset(size, slot_bytes) + rings_count(size) * ring_bytes;
}
}  // namespace

// One end of a ring: a count of bytes (written, or read) that only that end's rank moves, and
// the futex word the other end sleeps on.
struct alignas(kLine) RingEnd {
  std::atomic<uint64_t> count;
  std::atomic<uint32_t> epoch;    // bumped after every move of count
  std::atomic<uint32_t> waiters;  // the other end, asleep (or about to be) on epoch
};
struct SharedSlots::Ring {
  RingEnd written;  // the writer's (src)
  RingEnd read;     // the reader's (dst)
};
static_assert(sizeof(SharedSlots::Ring) == 2 * kLine, "ring heads are two cache lines");

bool SharedSlots::map(int fd, bool creating, std::string* why) {
  bytes_ = segment_bytes(size_, slot_bytes_, ring_bytes_);
  if (creating) {
    if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
      *why = "ftruncate: " + errno_text(errno);
      return false;
    }
    // Reserve the pages now: on a full /dev/shm a write to an unbacked page of the mapping would
    // be a SIGBUS in the middle of a collective.
    if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes_)); err != 0) {
      *why = "no room for " + std::to_string(bytes_ >> 10) + " KiB in /dev/shm (" +
             errno_text(err) + ")";
      return false;
    }
  } else {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes_) {
      *why = "the segment is not the size rank 0 made";
      return false;
    }
  }
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    *why = "mmap: " + errno_text(errno);
    return false;
  }
  base_ = p;
  header_ = static_cast<Header*>(p);
  data_ = static_cast<char*>(p) + data_offset(size_);
  return true;
}

std::unique_ptr<SharedSlots> SharedSlots::create(int size, size_t slot_bytes, std::string* why,
                                                 size_t ring_bytes) {
  WEFT_ASSERT(size > 1 && slot_bytes % kLine == 0 && ring_bytes % kPage == 0,
              "SharedSlots::create: bad size, slot bytes or ring bytes");
  std::unique_ptr<SharedSlots> s(new SharedSlots());
  s->size_ = size;
  s->rank_ = 0;
  s->slot_bytes_ = slot_bytes;
  s->ring_bytes_ = ring_bytes;
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32 ^ rd()) | 1;
  static std::atomic<uint64_t> made{0};
  char name[96];
  std::snprintf(name, sizeof name, "/weft-%d-%llu-%016llx", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(made++), static_cast<unsigned long long>(nonce));
  s->name_ = name;
  const int fd = ::shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    *why = std::string("shm_open ") + name + ": " + errno_text(errno);
    return nullptr;
  }
  const bool ok = s->map(fd, true, why);
  ::close(fd);
  if (!ok) {
    ::shm_unlink(name);
    return nullptr;
  }
  // A fresh tmpfs file reads zero: every rank's arrived count starts at 0.
  Header* h = s->header_;
  h->nonce = nonce;
  h->size = static_cast<uint64_t>(size);
  h->slot_bytes = slot_bytes;
  h->ring_bytes = ring_bytes;
  auto* line = reinterpret_cast<RankLine*>(static_cast<char*>(s->base_) + lines_offset());
  line->pid = ::getpid();
  line->pid_namespace = pid_namespace();
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;
  return s;
}

std::unique_ptr<SharedSlots> SharedSlots::open(const std::string& name, uint64_t nonce, int rank,
                                               int size, std::string* why) {
  WEFT_ASSERT(rank > 0 && rank < size, "SharedSlots::open: bad rank");
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    *why = "shm_open " + name + ": " + errno_text(errno) + " (not on rank 0's host?)";
    return nullptr;
  }
  std::unique_ptr<SharedSlots> s(new SharedSlots());
  s->name_ = name;
  s->rank_ = rank;
  s->size_ = size;
  // The slot size is rank 0's: read it from the header before mapping the rest.
  void* head = ::mmap(nullptr, sizeof(Header), PROT_READ, MAP_SHARED, fd, 0);
  if (head == MAP_FAILED) {
    *why = "mmap: " + errno_text(errno);
    ::close(fd);
    return nullptr;
  }
  const Header* h = static_cast<const Header*>(head);
  const bool same = h->magic == kMagic && h->nonce == nonce &&
                    h->size == static_cast<uint64_t>(size) && h->slot_bytes % kLine == 0 &&
                    h->ring_bytes % kPage == 0;
  s->slot_bytes_ = static_cast<size_t>(h->slot_bytes);
  s->ring_bytes_ = static_cast<size_t>(h->ring_bytes);
  ::munmap(head, sizeof(Header));
  if (!same) {
    *why = "segment " + name + " is not the one rank 0 made (another host's /dev/shm?)";
    ::close(fd);
    return nullptr;
  }
  const bool ok = s->map(fd, false, why);
  ::close(fd);
  if (!ok) return nullptr;
  auto* line = reinterpret_cast<RankLine*>(static_cast<char*>(s->base_) + lines_offset()) + rank;
  line->pid = ::getpid();
  line->pid_namespace = pid_namespace();
  return s;
}

SharedSlots::~SharedSlots() {
  if (base_) ::munmap(base_, bytes_);
}

uint64_t SharedSlots::nonce() const { return header_->nonce; }

void SharedSlots::unlink() { ::shm_unlink(name_.c_str()); }

std::string SharedSlots::exited_rank(int q) const {
  const auto* lines =
      reinterpret_cast<const RankLine*>(static_cast<const char*>(base_) + lines_offset());
  const uint64_t mine = lines[rank_].pid_namespace;
  const RankLine& l = lines[q];
  // A rank in another PID namespace (a container sharing this /dev/shm) cannot be checked.
  if (mine == 0 || l.pid_namespace != mine || l.pid <= 0 || !exited(l.pid)) return "";
  return "rank " + std::to_string(q) + " (process " + std::to_string(l.pid) + ") exited";
}

std::string SharedSlots::dead_rank(uint64_t seq) const {
  const auto* lines =
      reinterpret_cast<const RankLine*>(static_cast<const char*>(base_) + lines_offset());
  for (int q = 0; q < size_; ++q) {
    if (lines[q].arrived.load(std::memory_order_acquire) >= seq) continue;
    if (std::string dead = exited_rank(q); !dead.empty()) return dead;
  }
  return "";
}

namespace {
using Clock = std::chrono::steady_clock;

// Waits until ready(): spinning kSpin, then asleep on the futex `epoch` (counted in `waiters`) in
// slices of at most kCheckEvery, calling check() (which throws to end the wait) after each slice.
// Returns false when `until` passes first.
template <typename Ready, typename Check>
bool wait_until(std::atomic<uint32_t>& epoch, std::atomic<uint32_t>& waiters, Ready ready,
                Check check, Clock::time_point until) {
  const Clock::time_point t0 = Clock::now();
  for (int i = 1;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if (i % 64 == 0 && Clock::now() - t0 > kSpin) break;
  }
  Clock::time_point next_check = t0 + SharedSlots::kCheckEvery;
  for (;;) {
    waiters.fetch_add(1);
    const uint32_t seen = epoch.load();
    if (ready()) {
      waiters.fetch_sub(1);
      return true;
    }
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::min(next_check, until) - Clock::now());
    if (left.count() > 0) {
      timespec ts{static_cast<time_t>(left.count() / 1000000000),
                  static_cast<long>(left.count() % 1000000000)};
      // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch), FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
    waiters.fetch_sub(1);
    if (ready()) return true;
    const Clock::time_point now = Clock::now();
    if (now >= next_check) {
      check();
      next_check = now + SharedSlots::kCheckEvery;
    }
    if (now >= until) return false;
  }
}

// After a move that someone may sleep on: bump the futex word, and wake the sleepers.
void publish(std::atomic<uint32_t>& epoch, const std::atomic<uint32_t>& waiters) {
  epoch.fetch_add(1);  // seq_cst: ordered after the move (also seq_cst) and before the load below
  if (waiters.load() > 0)
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&epoch), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
              0);
}
}  // namespace

void SharedSlots::wait_all_arrived(uint64_t seq, const char* op,
                                   std::chrono::milliseconds timeout) {
  auto* lines = reinterpret_cast<RankLine*>(static_cast<char*>(base_) + lines_offset());
  auto all = [&] {
    for (int q = 0; q < size_; ++q)
      if (lines[q].arrived.load(std::memory_order_acquire) < seq) return false;
    return true;
  };
  auto alive = [&] {
    const std::string dead = dead_rank(seq);
    WEFT_CHECK(dead.empty(), "rank ", rank_, " of ", size_, ": ", op, " failed: ", dead,
               " while this rank waited for it (shared-memory collectives)");
  };
  if (wait_until(header_->epoch, header_->waiters, all, alive, Clock::now() + timeout)) return;
  std::string late;
  for (int q = 0; q < size_; ++q)
    if (lines[q].arrived.load() < seq) late += (late.empty() ? "" : ", ") + std::to_string(q);
  WEFT_FAIL("rank ", rank_, " of ", size_, ": ", op, " failed: rank(s) ", late,
            " did not arrive within ", timeout.count() / 1000.0,
            " s (shared-memory collectives: a peer hung, or the ranks called the group's "
            "collectives in different orders)");
}

// The pair's place among the size·(size-1) rings: src-major, dst skipping src.
size_t SharedSlots::ring_index(int src, int dst) const {
  WEFT_ASSERT(ring_bytes_ > 0 && src != dst && src >= 0 && dst >= 0 && src < size_ && dst < size_,
              "SharedSlots: no ring from ", src, " to ", dst);
  return static_cast<size_t>(src) * static_cast<size_t>(size_ - 1) +
         static_cast<size_t>(dst < src ? dst : dst - 1);
}

SharedSlots::Ring& SharedSlots::ring(int src, int dst) const {
  return reinterpret_cast<Ring*>(static_cast<char*>(base_) +
                                 ring_heads_offset(size_, slot_bytes_))[ring_index(src, dst)];
}

char* SharedSlots::ring_data(int src, int dst) const {
  return static_cast<char*>(base_) + ring_data_offset(size_, slot_bytes_) +
         ring_index(src, dst) * ring_bytes_;
}

size_t SharedSlots::ring_put(int dst, const char* data, size_t n) {
  Ring& r = ring(rank_, dst);
  const uint64_t written = r.written.count.load(std::memory_order_relaxed);  // ours
  const uint64_t read = r.read.count.load(std::memory_order_acquire);
  const size_t k = std::min<size_t>(n, ring_bytes_ - static_cast<size_t>(written - read));
  if (k == 0) return 0;
  char* ring = ring_data(rank_, dst);
  const size_t at = static_cast<size_t>(written % ring_bytes_);
  const size_t first = std::min(k, ring_bytes_ - at);
  std::memcpy(ring + at, data, first);
  std::memcpy(ring, data + first, k - first);
  r.written.count.store(written + k);  // seq_cst: the bytes, then the count, then the wake
  publish(r.written.epoch, r.written.waiters);
  return k;
}

size_t SharedSlots::ring_ready(int src) const {
  const Ring& r = ring(src, rank_);
  return static_cast<size_t>(r.written.count.load(std::memory_order_acquire) -
                             r.read.count.load(std::memory_order_relaxed));
}

size_t SharedSlots::ring_get(int src, char* out, size_t n) {
  Ring& r = ring(src, rank_);
  const uint64_t read = r.read.count.load(std::memory_order_relaxed);  // ours
  const uint64_t written = r.written.count.load(std::memory_order_acquire);
  const size_t k = std::min<size_t>(n, static_cast<size_t>(written - read));
  if (k == 0) return 0;
  const char* ring = ring_data(src, rank_);
  const size_t at = static_cast<size_t>(read % ring_bytes_);
  const size_t first = std::min(k, ring_bytes_ - at);
  std::memcpy(out, ring + at, first);
  std::memcpy(out + first, ring, k - first);
  r.read.count.store(read + k);  // the bytes are out before the room is given back
  publish(r.read.epoch, r.read.waiters);
  return k;
}

bool SharedSlots::ring_wait(int peer, bool space, size_t want, Clock::time_point until,
                            const char* op) const {
  Ring& r = space ? ring(rank_, peer) : ring(peer, rank_);
  want = std::min(want, ring_bytes_);
  auto ready = [&] {
    const uint64_t held = r.written.count.load() - r.read.count.load();
    return (space ? ring_bytes_ - static_cast<size_t>(held) : static_cast<size_t>(held)) >= want;
  };
  auto alive = [&] {
    const std::string dead = exited_rank(peer);
    WEFT_CHECK(dead.empty(), "rank ", rank_, " of ", size_, ": ", op, " failed: ", dead,
               " while this rank waited for it (shared-memory messages)");
  };
  // Room is given back by the reader's end; bytes come with the writer's.
  RingEnd& end = space ? r.read : r.written;
  return wait_until(end.epoch, end.waiters, ready, alive, until);
}

void SharedSlots::exchange(uint64_t what, const std::function<void(char* mine)>& write,
                           const std::function<void(const char* const* slots)>& read,
                           const char* op, std::chrono::milliseconds timeout) {
  WEFT_CHECK(!broken_, "rank ", rank_, " of ", size_, ": ", op,
             ": an earlier collective of this group failed (shared-memory collectives)");
  const uint64_t seq = ++seq_;
  const size_t set_index = seq % 2;
  char* set = data_ + set_index * static_cast<size_t>(size_) * slot_bytes_;
  write(set + static_cast<size_t>(rank_) * slot_bytes_);
  auto* lines = reinterpret_cast<RankLine*>(static_cast<char*>(base_) + lines_offset());
  lines[rank_].what[set_index] = what;
  lines[rank_].arrived.store(seq);  // seq_cst: ordered before the waiters' load in publish
  publish(header_->epoch, header_->waiters);
  try {
    wait_all_arrived(seq, op, timeout);
  } catch (...) {
    broken_ = true;
    throw;
  }
  for (int q = 0; q < size_; ++q) {
    if (lines[q].what[set_index] == what) continue;
    broken_ = true;
    WEFT_FAIL("rank ", rank_, " of ", size_, ": ", op, ": rank ", q,
              " called another collective, or passed another size, in the same place (every "
              "rank must call a group's collectives in the same order with the same shapes)");
  }
  std::vector<const char*> slots(static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) slots[q] = set + static_cast<size_t>(q) * slot_bytes_;
  read(slots.data());
}

}  // namespace weft::dist
