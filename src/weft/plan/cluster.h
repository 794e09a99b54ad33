// Cluster and device description, and the alpha-beta communication cost model.
//
// A cluster is `nodes` × `gpus_per_node` identical devices; global rank r sits on node
// r / gpus_per_node (the launchers' LOCAL_RANK-fastest numbering). Two links: intra-node
// (NVLink, or loopback TCP for CPU processes) and inter-node (the per-device NIC share). A
// message of n bytes over a link costs latency + n / bandwidth (alpha-beta).
//
// Collectives over a group of ranks use the group's bottleneck link: inter-node as soon as the
// group spans two nodes, intra-node otherwise (no hierarchical algorithms). With n ranks and
// `bytes` the size of the full tensor:
//   ring all-reduce       2(n-1)·α + 2(n-1)/n · bytes/B
//   ring all-gather       (n-1)·α + (n-1)/n · bytes/B       (bytes = the gathered tensor)
//   ring reduce-scatter   (n-1)·α + (n-1)/n · bytes/B       (bytes = the tensor before scatter)
//   all-to-all            (n-1)·α + (n-1)/n · bytes/B       (bytes = what one rank sends)
//   tree all-reduce       2⌈log2 n⌉·α + 2 · bytes/B         (pipelined reduce + broadcast)
// A group of one rank costs nothing; so does a p2p message to oneself.
//
// Blocking collectives of CPU tensors among the ranks of one node (TP's and SP's activations,
// CP's keys and values, the loss's and the gradient norm's sums) go through weft's shared-memory
// segment (dist/shm.h) when the run has train.shared_memory_collectives and the cluster a
// [shared_memory] link: every rank writes its piece into its own slot, waits once for every
// rank (the latency α), and reads what it needs, so the bandwidth B is one rank's copy rate:
//   all-reduce            α + (n+1) · bytes/B     (writes its tensor, reads all n and sums)
//   all-gather            α + (n+1)/n · bytes/B   (writes its 1/n, reads the gathered tensor)
//   reduce-scatter        α + 2 · bytes/B         (writes its tensor, reads its row of all n)
// Otherwise (no such link, the setting off, a group spanning nodes) they run the ring above.
// Point-to-point messages between two ranks of one node go through that segment's rings too
// where the run also has train.shared_memory_messages (dist/messages.h):
//   message               α + bytes/B
// The sender copies the message in and the receiver out, but plain copies run at about twice the
// rate of the summing reads B is fitted to (on the 2-core CPU, the profile's one-way 4 MB message
// took 0.49 ms, its two-rank 4 MB all-reduce 1.0 ms; cpu-local.toml: 20 us + 9 GB/s).
//
// Cluster file (TOML), errors naming the file, the key, the value and what is allowed:
//   nodes = 1
//   gpus_per_node = 8
//   device = "h100"                  # a shipped profile, or an inline table:
//   # [device]  base = "h100" (optional: start from a profile), name, bf16_tflops,
//   #           fp32_tflops, memory_gib, hbm_gbs, matmul_efficiency,
//   #           block_overhead_us (fixed microseconds per block per forward and backward),
//   #           reserved_gib (memory plans must leave free; less than memory_gib)
//   [intra_node]
//   bandwidth_gbs = 450              # GB/s (1e9 bytes/s) per direction, per device
//   latency_us = 3
//   [inter_node]                     # required when nodes > 1
//   bandwidth_gbs = 50
//   latency_us = 5
//   [shared_memory]                  # optional: CPU ranks' blocking collectives (above)
//   bandwidth_gbs = 9
//   latency_us = 20
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "weft/core/spec.h"

namespace weft::plan {

struct DeviceProfile {
  std::string name;
  double peak_bf16_flops = 0;  // dense bf16 peak, FLOP/s
  double peak_fp32_flops = 0;  // fp32 peak, FLOP/s (what an fp32 run is measured against)
  double memory_bytes = 0;     // device memory
  // Memory a run cannot give to weights, gradients, moments and activations: the CUDA context,
  // the communicators' buffers, the caching allocator's fragmentation. The planner fits plans
  // into usable_memory_bytes(). 0 in the shipped profiles (unmeasured); `reserved_gib` in a
  // cluster file's [device] table.
  double reserved_bytes = 0;
  double hbm_bytes_per_second = 0;  // memory bandwidth (optimizer step); 0 = unknown
  double matmul_efficiency = 1;     // achievable fraction of peak on the model's matmul work
  // Fixed seconds of each transformer block's forward, and again of its backward, per microbatch
  // whatever its size: operator dispatch and kernel launches the FLOP rate misses (what makes
  // many small microbatches slower than few large ones). 0 = none; a measured profile
  // (plan/profile.h) replaces the FLOP model, this included.
  double block_overhead_seconds = 0;

  double usable_memory_bytes() const { return memory_bytes - reserved_bytes; }
  double peak_flops(Precision p) const {
    return p == Precision::kBf16 ? peak_bf16_flops : peak_fp32_flops;
  }
  // FLOP/s the cost model charges compute at.
  double effective_flops(Precision p) const { return peak_flops(p) * matmul_efficiency; }
};

// Shipped profiles: "h100", "h200" (SXM, bf16 dense 989 TFLOP/s), "cpu-core" (one core of this
// machine). Unknown name: an Error listing the known ones.
DeviceProfile device_profile(const std::string& name);
std::vector<std::string> device_profile_names();

struct Link {
  double bytes_per_second = 0;
  double latency_seconds = 0;
  double seconds(double bytes) const { return latency_seconds + bytes / bytes_per_second; }
};

struct Cluster {
  std::string source;  // file it came from (for messages)
  int64_t nodes = 1, gpus_per_node = 1;
  DeviceProfile device;
  Link intra_node, inter_node;
  Link shared_memory;  // [shared_memory]; bytes_per_second 0: none (the ring on intra_node)

  int64_t world_size() const { return nodes * gpus_per_node; }
  int64_t node_of(int64_t rank) const { return rank / gpus_per_node; }
};

Cluster parse_cluster(const std::string& toml_text, const std::string& source);
// Reads and parses a cluster file; a missing/unreadable file is an Error naming it.
Cluster load_cluster(const std::string& path);
std::string to_json(const Cluster& cluster);

enum class CollectiveAlgo { kRing, kTree };
enum class CollectiveKind { kAllReduce, kAllGather, kReduceScatter };

// The slowest link a group of ranks communicates over (inter-node iff it spans nodes).
const Link& bottleneck_link(const Cluster& c, const std::vector<int64_t>& ranks);
double p2p_seconds(const Cluster& c, int64_t src, int64_t dst, double bytes);
double all_reduce_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes,
                          CollectiveAlgo algo = CollectiveAlgo::kRing);
double all_gather_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes);
double reduce_scatter_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes);
// All-to-all (expert parallelism's dispatch / combine) where every rank sends `bytes` in all,
// spread evenly over the group: n - 1 pairwise rounds, (n-1)·α + (n-1)/n · bytes/B.
double all_to_all_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes);

// Whether the run's blocking collectives between ranks of one node go through shared memory:
// train.shared_memory_collectives and a [shared_memory] link.
bool shared_memory_collectives(const Spec& spec, const Cluster& c);
// A blocking collective (one waited for where it is issued, the kinds above): through shared
// memory where shared_memory_collectives(spec, c) and the group sits on one node, else the ring.
double blocking_collective_seconds(const Spec& spec, const Cluster& c,
                                   const std::vector<int64_t>& ranks, CollectiveKind kind,
                                   double bytes);
// Whether the run's point-to-point messages between ranks of one node go through shared memory:
// shared_memory_collectives(spec, c) and train.shared_memory_messages.
bool shared_memory_messages(const Spec& spec, const Cluster& c);
// A point-to-point message: through shared memory where shared_memory_messages(spec, c) and
// both ranks are on one node, else p2p_seconds.
double message_seconds(const Spec& spec, const Cluster& c, int64_t src, int64_t dst, double bytes);

}  // namespace weft::plan
