// SharedSlots: the ranks of one group on one host exchanging data through a shared-memory
// segment, for Comm's blocking CPU collectives (comm.h). Over Gloo's TCP loopback a 400 KB
// all-reduce between two ranks of a busy 2-core host takes 1-10 ms, most of it waiting for the
// transport threads of both processes to get a core; here a rank copies its data into its own
// slot, waits until every rank has (spinning briefly, then on a futex), and reads every slot.
//
// Protocol. Each exchange has a sequence number s (1, 2, ...; the same on every rank, since
// every rank calls a group's collectives in the same order) and uses slot set s % 2. A rank
// writes its slot of that set, publishes arrived[rank] = s, waits until every rank has
// arrived at s, and reads. Two sets make a second barrier unnecessary: a rank that arrives at s
// has finished reading exchange s - 1's set, so once every rank has arrived at s, the set of
// s - 1 (= the set of s + 1) is free for rank-wise writing again.
//
// Rings (groups made with ring_bytes > 0: those that carry point-to-point messages, comm.h).
// Each ordered pair of ranks (src, dst) has one byte ring, written only by src and read only by
// dst: two monotonic counters (bytes written, bytes read), each published with a release store
// and a bump of its futex word. A writer never waits for its reader unless the ring is full;
// framing and matching of messages are the caller's (dist/messages.h).
//
// Failures: a wait ends with weft::Error when the group's timeout passes, or at once (within
// kCheckEvery) when a rank's process has exited, naming the rank. Nothing here is torch's.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace weft::dist {

// The element types sum_slots adds.
enum class SlotType { kFloat, kDouble, kBFloat16 };

// dst[i] = the sum over ranks q, in rank order, of element i of slots[q] + offset, for i < len:
// bf16 accumulated in fp32 and rounded to nearest even once (as Gloo's fp32 path and
// at::BFloat16 do), so every rank gets the same bits. Compiled for the vectoriser (-O3).
void sum_slots(SlotType type, void* dst, const char* const* slots, int size, size_t offset,
               int64_t len);

class SharedSlots {
 public:
  // Made by the group's rank 0: a fresh segment of `size` ranks' slot pairs of `slot_bytes`
  // each, named in name(), with a random nonce() the others check. Null where it cannot be made
  // (no /dev/shm, or not room for it there): the reason goes to *why.
  // ring_bytes: each ordered pair's ring (a multiple of 4096; 0 for none).
  static std::unique_ptr<SharedSlots> create(int size, size_t slot_bytes, std::string* why,
                                             size_t ring_bytes = 0);
  // Opened by rank `rank` (> 0) from rank 0's name() and nonce(). Null where the segment is not
  // there or not the one rank 0 made (another host, or another /dev/shm): the reason in *why.
  static std::unique_ptr<SharedSlots> open(const std::string& name, uint64_t nonce, int rank,
                                           int size, std::string* why);
  ~SharedSlots();
  SharedSlots(const SharedSlots&) = delete;
  SharedSlots& operator=(const SharedSlots&) = delete;

  const std::string& name() const { return name_; }
  uint64_t nonce() const;
  size_t slot_bytes() const { return slot_bytes_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Removes the segment's name (rank 0, once every rank has it open): it lives on while mapped
  // and goes with the last process to unmap it, whatever happens to them.
  void unlink();

  // One exchange: `write` fills this rank's slot (slot_bytes() bytes), then, once every rank has
  // written its own, `read` gets every rank's slot (slots[r] for rank r). `what` identifies the
  // collective and its size: a rank whose `what` differs from this rank's is an error (ranks out
  // of step would otherwise read each other's bytes as something else), and so is every later
  // exchange of the group. `op` names the collective in errors; `timeout` is the group's.
  void exchange(uint64_t what, const std::function<void(char* mine)>& write,
                const std::function<void(const char* const* slots)>& read, const char* op,
                std::chrono::milliseconds timeout);

  // ---- rings (ring_bytes() > 0) ----
  size_t ring_bytes() const { return ring_bytes_; }
  // Copies as much of data[0, n) as the ring to `dst` has room for now and publishes it;
  // returns the bytes copied (0 when the ring is full). One writer thread at a time per ring.
  size_t ring_put(int dst, const char* data, size_t n);
  // Copies up to n bytes that the ring from `src` holds now into out and frees their room;
  // returns the bytes copied. One reader thread at a time per ring.
  size_t ring_get(int src, char* out, size_t n);
  // Bytes ring_get(src, ...) could take now.
  size_t ring_ready(int src) const;
  // Waits (spinning briefly, then on a futex) until the ring to `peer` has `want` bytes of room
  // (space = true) or the ring from `peer` holds `want` bytes (space = false), but not past
  // `until`: returns whether it came. Throws weft::Error naming `op` and the peer when the peer's
  // process has exited.
  bool ring_wait(int peer, bool space, size_t want, std::chrono::steady_clock::time_point until,
                 const char* op) const;

  // "" while rank q's process is alive (or cannot be checked: another PID namespace), else
  // "rank q (process P) exited".
  std::string exited_rank(int q) const;

  // How often a waiting rank checks that the ranks it waits for are alive.
  static constexpr std::chrono::milliseconds kCheckEvery{50};

  struct Header;  // the segment's first bytes (shm.cpp)
  struct Ring;    // a ring's two ends (shm.cpp)

 private:
  SharedSlots() = default;
  bool map(int fd, bool creating, std::string* why);
  void wait_all_arrived(uint64_t seq, const char* op, std::chrono::milliseconds timeout);
  std::string dead_rank(uint64_t seq) const;  // "" when every rank short of seq is alive
  size_t ring_index(int src, int dst) const;
  Ring& ring(int src, int dst) const;
  char* ring_data(int src, int dst) const;

  std::string name_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t slot_bytes_ = 0;
  size_t ring_bytes_ = 0;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;     // exchanges done
  bool broken_ = false;  // an exchange failed: the ranks are out of step
  Header* header_ = nullptr;
  char* data_ = nullptr;
};

}  // namespace weft::dist
