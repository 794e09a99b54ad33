// `weft bench profile`: measures what each layer of a config's modules costs on this device —
// forward, input-gradient and weight-gradient seconds, activation bytes, parameters and the
// optimizer's seconds — at several microbatch shapes of the config's own data, fits the
// rescaling model, and measures the data preparation per sample and the local Gloo transport.
// The result is the JSON file plan/profile.h reads (its header documents the quantities, the
// fits and how a Plan uses them).
//
// How input- and weight-gradient time are told apart: every measurement runs the layer's forward
// and backward once with its parameters requiring grad (full backward) and once without (input
// gradients only, its input requiring grad); weight_grad is the difference. A layer whose input
// is data (an encoder's front end) has no input gradient: its backward is all weight gradient.
// Activation bytes are counted by the CPU allocator's memory reporting hook while the forward
// runs (what is still allocated when it returns, the output included).
//
// Runs single-process with train.threads intra-op threads (0 = all cores); timings are medians
// over `reps` repetitions after `warmup` untimed ones. Each layer is measured alone and, when
// the machine has further cores, again while they train other copies of the model (what the
// layer costs when the other ranks of a node compute at the same time: shared caches and memory
// bandwidth). The transport is measured between two threads of this process over loopback TCP
// (Gloo), as two local ranks would use it.
#pragma once

#include <cstdint>
#include <string>

#include "weft/core/spec.h"

namespace weft::train {

struct ProfileOptions {
  int64_t reps = 5;    // timed repetitions per measurement (median)
  int64_t warmup = 2;  // untimed repetitions first
  bool comm = true;    // measure Gloo point-to-point and all-reduce with a peer process
  // Measure every layer a second time while the machine's other cores (one background trainer
  // per further `train.threads` cores) run training steps: the "shared" costs of ranks that
  // compute at the same time (plan/profile.h).
  bool shared = true;
};

// The profile of `spec` on this device as JSON text (plan/profile.h format). With options.comm
// it starts its transport peer as `/proc/self/exe bench comm-peer`: call it from weft itself.
std::string profile_config(Spec spec, const ProfileOptions& options);

// The second rank of the profile's transport measurement, in a process of its own
// (`weft bench comm-peer`, which profile_config starts): joins rank 0 on 127.0.0.1:port and
// runs the same rounds. dtype: "bf16" or "fp32" (the compute dtype); shared_memory: as rank 0's
// train.shared_memory_collectives; messages: as its train.shared_memory_messages.
void comm_peer(int port, int64_t reps, int64_t warmup, const std::string& dtype, bool shared_memory,
               bool messages);

}  // namespace weft::train
