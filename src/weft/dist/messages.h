// SharedMessages: Comm's point-to-point messages between ranks of one host, through the
// group's shared-memory rings (dist/shm.h), for groups made to carry them (Comm::subgroup's
// `messages`). Over Gloo's TCP loopback a message between two ranks of a busy 2-core host takes
// 0.4-0.7 ms however small, most of it waiting for the transport threads of both processes to
// get a core; here the sender copies the message into the ring and the receiver copies it out.
//
// Framing: each message is a 16-byte header (tag, payload bytes) and its payload, in order, on
// the ring from its sender to its receiver. Matching (as c10d's and MPI's): a message goes to the
// earliest receive posted for its (source, tag) that has none yet; one that finds none is kept
// aside (unexpected) for the next such receive. A receiver reads its rings only while it waits
// for a receive, and reads each ring in order, so a message behind others is reached by taking
// those out first (into their posted tensors, or aside).
//
// Sends never wait: a message goes into the ring at once where it fits behind what is queued;
// else (a full ring, or a message larger than it) it is queued, and a sender thread of the group
// moves it in as the receiver frees room. The send's Pending holds the tensor until then, as
// Gloo's does. So a rank never blocks on a send its peer has not reached, as with Gloo.
//
// Failures: a receive not complete within the group's timeout, or a send whose receiver takes
// none of it for that long, ends with weft::Error naming the peer and tag; so does a peer whose
// process exited, within SharedSlots::kCheckEvery. A received message of another size than the
// receive's tensor is an error naming both. After a failed send to a rank, or a failed read of a
// rank's ring, later sends to it (receives from it) fail at once with the first cause.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "weft/dist/comm.h"
#include "weft/dist/shm.h"

namespace weft::dist {

class SharedMessages {
 public:
  // `rings` (with ring_bytes() > 0) must outlive this.
  SharedMessages(SharedSlots& rings, std::chrono::milliseconds timeout);
  ~SharedMessages();  // fails the sends still queued
  SharedMessages(const SharedMessages&) = delete;
  SharedMessages& operator=(const SharedMessages&) = delete;

  // `t`: a contiguous CPU tensor, held until the Pending is waited.
  Pending send(const at::Tensor& t, int dst, int tag);
  // `t`: a contiguous CPU tensor of the message's bytes, filled by the time the Pending is
  // waited.
  Pending irecv(const at::Tensor& t, int src, int tag);

 private:
  struct Outgoing;
  struct Incoming;
  struct Source;  // what this rank has read of the ring from one source

  // Writes what fits of `m` (header first, whole); returns whether all of it is in.
  bool put(int dst, Outgoing& m);
  void sender_loop();
  // Reads what the ring from `src` holds into its messages' tensors; under in_mu_.
  void take(int src);
  void wait_received(const std::shared_ptr<Incoming>& in, int src, int tag);

  SharedSlots& rings_;
  const std::chrono::milliseconds timeout_;
  const int rank_, size_;

  std::mutex out_mu_;
  std::condition_variable out_cv_;   // the sender thread's: sends queued, or stopping
  std::condition_variable done_cv_;  // queued sends finished
  std::vector<std::deque<std::shared_ptr<Outgoing>>> queued_;  // per destination, in order
  bool stopping_ = false;
  // Per destination: why a send to it failed (its ring may hold part of a message: later sends
  // to it are refused with this cause).
  std::vector<std::string> send_failed_;
  std::thread sender_;  // started at the first queued send

  std::mutex in_mu_;
  std::vector<Source> sources_;
  // Per source: why reading its ring failed (it may be out of step: later receives from it fail
  // with this cause).
  std::vector<std::string> recv_failed_;
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Incoming>>> posted_, unexpected_;
};

}  // namespace weft::dist
