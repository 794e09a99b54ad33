#include "weft/dist/comm.h"

#include <ATen/record_function.h>
#include <torch/torch.h>
#include <torch/version.h>  // TORCH_VERSION_MAJOR: the Backend alias

#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef WEFT_CUDA  // a CUDA LibTorch (2.x): NCCL for device tensors
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "weft/core/error.h"
#include "weft/dist/messages.h"
#include "weft/dist/shm.h"

namespace weft::dist {

namespace {
thread_local double t_blocked_seconds = 0;  // blocked_seconds()
}  // namespace

double blocked_seconds() { return t_blocked_seconds; }

namespace {
// Adds the calling thread's seconds in `f` to blocked_seconds().
template <typename F>
auto blocked(F&& f) {
  struct Clock {
    std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
    ~Clock() {
      t_blocked_seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } clock;
  return f();
}

// An error's message without c10's stack trace.
std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

// LibTorch >= 2.4 asks TCPStore for its libuv back end by default, which a LibTorch built
// without libuv (Debian's 2.x) refuses: turn it off where the option exists and is on.
template <typename O>
auto drop_libuv(O& o, int) -> decltype(o.useLibUV = false, bool()) {
  const bool was = o.useLibUV;
  o.useLibUV = false;
  return was;
}
template <typename O>
bool drop_libuv(O&, long) {
  return false;
}

int env_int(const char* name, int fallback, int min_value) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  WEFT_CHECK(end && *end == '\0' && x >= min_value && x <= 1 << 30, "environment variable ", name,
             "='", v, "': expected an integer >= ", min_value);
  return static_cast<int>(x);
}

bool has_env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v;
}

std::shared_ptr<::gloo::transport::Device> make_device(const std::string& master_addr) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname)
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  if (master_addr == "127.0.0.1" || master_addr == "localhost")
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

}  // namespace

WorldInfo world_from_env() {
  WorldInfo w;
  if (has_env("RANK") || has_env("WORLD_SIZE")) {
    w.rank = env_int("RANK", 0, 0);
    w.world_size = env_int("WORLD_SIZE", 1, 1);
    w.local_rank = env_int("LOCAL_RANK", w.rank, 0);
  } else if (has_env("OMPI_COMM_WORLD_SIZE")) {
    w.rank = env_int("OMPI_COMM_WORLD_RANK", 0, 0);
    w.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1, 1);
    w.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", w.rank, 0);
  } else if (has_env("SLURM_NTASKS")) {
    w.rank = env_int("SLURM_PROCID", 0, 0);
    w.world_size = env_int("SLURM_NTASKS", 1, 1);
    w.local_rank = env_int("SLURM_LOCALID", w.rank, 0);
  }
  WEFT_CHECK(w.rank < w.world_size, "rank ", w.rank, " is not below the world size ", w.world_size,
             " (check RANK / WORLD_SIZE)");
  if (const char* a = std::getenv("MASTER_ADDR"); a && *a) w.master_addr = a;
  w.master_port = env_int("MASTER_PORT", w.master_port, 1);
  WEFT_CHECK(w.master_port < 65536, "MASTER_PORT=", w.master_port, ": expected a port < 65536");
  return w;
}

// What Gloo and NCCL process groups have in common (their collectives' signatures).
#if TORCH_VERSION_MAJOR >= 2
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif

struct Comm::Impl {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;  // null for the single-rank group
  // Device tensors' collectives (NCCL; null on CPU-only builds and groups): built with the
  // group when it was connected with device collectives. CPU tensors (control messages, loss
  // sums) keep using Gloo, and point-to-point messages go over Gloo through host memory (they
  // are matched by tag, which NCCL does not do).
  c10::intrusive_ptr<Backend> device;
  bool device_collectives = false;
  // The blocking collectives of CPU tensors between ranks of one host (comm.h shared_memory()):
  // null where the group has ranks on several hosts, or was connected without.
  std::unique_ptr<SharedSlots> shm;
  // Point-to-point messages of CPU tensors (and of device tensors through host memory) through
  // shm's rings: groups made to carry messages (subgroup's `messages`) that have shm. Declared
  // after shm: destroyed before it.
  std::unique_ptr<SharedMessages> messages;
  bool shared_memory = true;  // wanted: subgroups ask for it too
  int rank = 0, size = 1;
  std::string master_addr = "127.0.0.1";
  std::chrono::milliseconds timeout{60000};
  mutable int64_t subgroups_made = 0;

  // Whether a collective of `t` goes through host memory over Gloo: a device tensor on a group
  // without a device backend (connected without device collectives, as in-process test ranks
  // sharing one GPU are). One copy to the host and one back per collective.
  bool staged(const at::Tensor& t) const { return t.is_cuda() && !device; }

  // The process group for collectives of `t` (not staged).
  Backend& group_for(const at::Tensor& t) const {
    if (t.is_cuda()) {
      WEFT_ASSERT(device, "a device tensor's collective on a group without a device backend");
      return *device;
    }
    WEFT_CHECK(t.is_cpu(), "rank ", rank, ": collectives take CPU or CUDA tensors, not ",
               t.device());
    return *pg;
  }

  // Whether a blocking collective of `t` goes through the shared-memory slots.
  bool shared(const at::Tensor& t) const { return shm && t.is_cpu(); }

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* op) const {
    RECORD_FUNCTION(std::string("weft::wait ") + op, std::vector<c10::IValue>());
    try {
      if (std::strcmp(op, "send") != 0 && std::strcmp(op, "recv") != 0)  // collectives only
        blocked([&] { work->wait(); });
      else
        work->wait();
    } catch (const std::exception& e) {
      WEFT_FAIL("rank ", rank, " of ", size, ": ", op,
                " failed (a peer died, hung or timed out "
                "after ",
                timeout.count() / 1000.0, " s): ", message_of(e));
    }
  }
};

namespace {
// Slot bytes per rank and slot set: 8 MiB in all for the group's two sets, at most 2 MiB each.
// A group with device collectives moves only small host tensors (loss sums, flags) this way:
// 64 KiB slots.
size_t slot_bytes_for(int size, bool device_collectives) {
  if (device_collectives) return 64 << 10;
  const size_t per = (size_t{4} << 20) / static_cast<size_t>(size) / 4096 * 4096;
  return std::min<size_t>(std::max<size_t>(per, 64 << 10), 2 << 20);
}

// Ring bytes per ordered pair of a group that carries messages: 16 MiB in all, each between
// 256 KiB and 4 MiB (a message larger than its ring streams through it).
size_t ring_bytes_for(int size) {
  const size_t pairs = static_cast<size_t>(size) * static_cast<size_t>(size - 1);
  const size_t per = (size_t{16} << 20) / pairs / 4096 * 4096;
  return std::min<size_t>(std::max<size_t>(per, 256 << 10), 4 << 20);
}

// The group's shared-memory slots, where every rank can map the segment rank 0 makes (so every
// rank is on rank 0's host): rank 0 makes it and names it in the store, the others open it, and
// all agree over Gloo, so that every rank takes the same path. Rank 0 then removes the name;
// the segment goes with the last rank to exit.
void connect_shared_slots(Comm::Impl& impl, size_t ring_bytes) {
  const std::string key = "weft/shm";
  std::string why;
  std::unique_ptr<SharedSlots> slots;
  try {
    if (impl.rank == 0) {
      slots = SharedSlots::create(impl.size, slot_bytes_for(impl.size, impl.device_collectives),
                                  &why, ring_bytes);
      if (!slots)  // rare (a full /dev/shm, say) and slower: said once per group
        std::fprintf(stderr,
                     "weft: a group of %d ranks uses Gloo for its blocking collectives: no "
                     "shared memory for it (%s)\n",
                     impl.size, why.c_str());
      std::string v = slots ? slots->name() + " " + std::to_string(slots->nonce()) : "-";
      impl.store->set(key, std::vector<uint8_t>(v.begin(), v.end()));
    } else {
      const std::vector<uint8_t> v = impl.store->get(key);
      const std::string text(v.begin(), v.end());
      const size_t space = text.find(' ');
      if (space != std::string::npos)
        slots = SharedSlots::open(text.substr(0, space), std::stoull(text.substr(space + 1)),
                                  impl.rank, impl.size, &why);
    }
    at::Tensor ok = torch::tensor({slots ? 1 : 0}, torch::kInt);
    std::vector<at::Tensor> v{ok};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MIN;
    impl.wait(impl.pg->allreduce(v, opts), "connecting shared-memory collectives");
    if (impl.rank == 0 && slots) slots->unlink();
    if (ok.item<int>() == 1) impl.shm = std::move(slots);
    if (impl.shm && ring_bytes > 0)
      impl.messages = std::make_unique<SharedMessages>(*impl.shm, impl.timeout);
  } catch (const weft::Error&) {
    throw;
  } catch (const std::exception& e) {
    WEFT_FAIL("rank ", impl.rank, " of ", impl.size,
              ": connecting shared-memory collectives: ", message_of(e));
  }
}

std::shared_ptr<Comm::Impl> make_group(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                       const std::string& master_addr,
                                       std::chrono::milliseconds timeout, bool device_collectives,
                                       bool shared_memory, bool messages = false) {
  auto impl = std::make_shared<Comm::Impl>();
  impl->shared_memory = shared_memory;
  impl->store = store;
  impl->rank = rank;
  impl->size = size;
  impl->master_addr = master_addr;
  impl->timeout = timeout;
  impl->device_collectives = device_collectives;
  if (size > 1) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    opts->devices.push_back(make_device(master_addr));
    try {
      impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
    } catch (const std::exception& e) {
      WEFT_FAIL("rank ", rank, " of ", size, ": could not connect the Gloo group: ", message_of(e));
    }
  }
  if (size > 1 && shared_memory) connect_shared_slots(*impl, messages ? ring_bytes_for(size) : 0);
  if (size > 1 && device_collectives) {
#ifdef WEFT_CUDA
    // NCCL's communicator is made on the first collective, on the current device (set_device).
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    auto nccl_store = c10::make_intrusive<c10d::PrefixStore>("nccl", store);
    try {
      impl->device = c10::make_intrusive<c10d::ProcessGroupNCCL>(nccl_store, rank, size, opts);
    } catch (const std::exception& e) {
      WEFT_FAIL("rank ", rank, " of ", size, ": could not make the NCCL group: ", message_of(e));
    }
#else
    WEFT_FAIL("rank ", rank,
              ": device collectives need a CUDA build of weft (this one is CPU-only)");
#endif
  }
  return impl;
}
}  // namespace

Comm::Comm() : impl_(std::make_shared<Impl>()) {}

Comm Comm::connect(const WorldInfo& world, std::chrono::milliseconds timeout,
                   bool device_collectives, bool shared_memory) {
  Comm c;
  if (world.world_size == 1) return c;
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(world.master_port);
  opts.isServer = world.rank == 0;
  opts.numWorkers = world.world_size;
  opts.waitWorkers = false;  // 1.13's server wait ignores the timeout: we wait ourselves below
  opts.timeout = timeout;
  c10::intrusive_ptr<c10d::Store> store;
  for (;;) {
    try {
      store = c10::make_intrusive<c10d::TCPStore>(world.master_addr, opts);
      break;
    } catch (const std::exception& e) {
      const std::string why = message_of(e);
      if (why.find("libuv") != std::string::npos && drop_libuv(opts, 0)) continue;
      WEFT_FAIL("rank ", world.rank, " of ", world.world_size, ": rendezvous at ",
                world.master_addr, ":", world.master_port, " failed within ",
                timeout.count() / 1000.0, " s (did every rank start?): ", why);
    }
  }
  // Check in, then wait for every rank until the deadline.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::string key = "weft/rendezvous/arrived";
  int64_t arrived = store->add(key, 1);
  while (arrived < world.world_size) {
    WEFT_CHECK(std::chrono::steady_clock::now() < deadline, "rank ", world.rank, " of ",
               world.world_size, ": only ", arrived, " of ", world.world_size,
               " ranks arrived at the rendezvous ", world.master_addr, ":", world.master_port,
               " within ", timeout.count() / 1000.0,
               " s (did every rank start, with the same MASTER_ADDR and MASTER_PORT?)");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    arrived = store->add(key, 0);
  }
  c.impl_ = make_group(store, world.rank, world.world_size, world.master_addr, timeout,
                       device_collectives, shared_memory);
  return c;
}

Comm Comm::in_memory(const std::string& store_key, int rank, int size,
                     std::chrono::milliseconds timeout, bool shared_memory) {
  static std::mutex mu;
  static std::map<std::string, c10::intrusive_ptr<c10d::Store>> stores;
  c10::intrusive_ptr<c10d::Store> store;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& s = stores[store_key];
    if (!s) s = c10::make_intrusive<c10d::HashStore>();
    store = s;
  }
  Comm c;
  c.impl_ = make_group(store, rank, size, "127.0.0.1", timeout, /*device_collectives=*/false,
                       shared_memory);
  return c;
}

int Comm::rank() const { return impl_->rank; }
int Comm::size() const { return impl_->size; }
bool Comm::shared_memory() const { return impl_->shm != nullptr; }
bool Comm::shared_memory_messages() const { return impl_->messages != nullptr; }

Comm Comm::subgroup(const std::vector<int>& ranks, bool messages) const {
  WEFT_CHECK(!ranks.empty(), "subgroup: empty rank list");
  for (size_t i = 0; i < ranks.size(); ++i)
    WEFT_CHECK(ranks[i] >= 0 && ranks[i] < size() && (i == 0 || ranks[i] > ranks[i - 1]),
               "subgroup: ranks must be ascending, unique and below ", size());
  const int64_t id = impl_->subgroups_made++;  // same count on every rank: all ranks call
  Comm c;
  auto it = std::find(ranks.begin(), ranks.end(), rank());
  if (it == ranks.end() || ranks.size() == 1) return c;
  std::string prefix = "weft/subgroup/" + std::to_string(id);
  for (int r : ranks) prefix += "_" + std::to_string(r);
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, impl_->store);
  c.impl_ = make_group(store, static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()),
                       impl_->master_addr, impl_->timeout, impl_->device_collectives,
                       impl_->shared_memory, messages);
  return c;
}

namespace {
// Gloo on LibTorch 1.13 cannot reduce bf16: reduce in fp32 and copy back (NCCL can).
bool needs_fp32(const at::Tensor& t) {
  return !t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

// Shared-memory collectives (Impl::shm): the tensor goes through the slots in pieces of at most a
// slot, one exchange each. Every rank reads every slot and sums them in rank order, so every rank
// gets the same bits (as Gloo's; 2-byte floats are summed in fp32 as Gloo's path does).
enum class SharedOp : uint64_t { kSum = 1, kMax, kGather, kScatter };

// An exchange's identity, the same on every rank that makes the same call (SharedSlots::exchange).
uint64_t what_of(SharedOp op, at::ScalarType type, int64_t numel) {
  return static_cast<uint64_t>(op) << 56 | static_cast<uint64_t>(type) << 48 |
         (static_cast<uint64_t>(numel) & ((uint64_t{1} << 48) - 1));
}

at::Tensor slot_view(const char* slot, int64_t len, at::ScalarType type) {
  return at::from_blob(const_cast<char*>(slot), {len}, at::TensorOptions().dtype(type));
}

// dst = the sum over ranks of their slots' first dst.numel() elements, from byte `offset`
// (dist::sum_slots; half through fp32 and integers through ATen).
void sum_slots(at::Tensor dst, const char* const* slots, int size, size_t offset) {
  const int64_t len = dst.numel();
  const at::ScalarType type = dst.scalar_type();
  switch (type) {
    case at::kFloat:
      return dist::sum_slots(SlotType::kFloat, dst.data_ptr(), slots, size, offset, len);
    case at::kDouble:
      return dist::sum_slots(SlotType::kDouble, dst.data_ptr(), slots, size, offset, len);
    case at::kBFloat16:
      return dist::sum_slots(SlotType::kBFloat16, dst.data_ptr(), slots, size, offset, len);
    case at::kHalf: {
      at::Tensor acc = slot_view(slots[0] + offset, len, type).to(at::kFloat);
      for (int q = 1; q < size; ++q) acc.add_(slot_view(slots[q] + offset, len, type));
      dst.copy_(acc);
      return;
    }
    default:
      at::add_out(dst, slot_view(slots[0] + offset, len, type),
                  slot_view(slots[1] + offset, len, type));
      for (int q = 2; q < size; ++q) dst.add_(slot_view(slots[q] + offset, len, type));
  }
}

void shared_all_reduce(const Comm::Impl& impl, at::Tensor& t, bool max, const char* op) {
  RECORD_FUNCTION(std::string("weft::shm ") + op, std::vector<c10::IValue>({t}));
  WEFT_CHECK(t.is_contiguous(), op, ": tensor must be contiguous");
  SharedSlots& s = *impl.shm;
  const size_t es = t.element_size();
  const int64_t per = static_cast<int64_t>(s.slot_bytes() / es), n = t.numel();
  const at::ScalarType type = t.scalar_type();
  const uint64_t what = what_of(max ? SharedOp::kMax : SharedOp::kSum, type, n);
  at::Tensor flat = t.view({-1});
  const char* data = static_cast<const char*>(t.data_ptr());
  for (int64_t off = 0; off < n; off += per) {
    const int64_t len = std::min(per, n - off);
    at::Tensor dst = flat.narrow(0, off, len);
    s.exchange(
        what, [&](char* mine) { std::memcpy(mine, data + off * es, len * es); },
        [&](const char* const* slots) {
          if (!max) return sum_slots(dst, slots, s.size(), 0);
          for (int q = 0; q < s.size(); ++q)
            if (q != s.rank()) at::maximum_out(dst, dst, slot_view(slots[q], len, type));
        },
        op, impl.timeout);
  }
}

at::Tensor shared_all_gather(const Comm::Impl& impl, const at::Tensor& t) {
  RECORD_FUNCTION("weft::shm all_gather", std::vector<c10::IValue>({t}));
  SharedSlots& s = *impl.shm;
  const at::Tensor in = t.dim() == 0 ? t.reshape({1}) : t.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] *= s.size();
  at::Tensor out = torch::empty(shape, in.options());
  const size_t bytes = in.nbytes(), piece = s.slot_bytes();
  const char* src = static_cast<const char*>(in.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const uint64_t what = what_of(SharedOp::kGather, in.scalar_type(), in.numel());
  for (size_t off = 0; off < bytes; off += piece) {
    const size_t len = std::min(piece, bytes - off);
    s.exchange(
        what, [&](char* mine) { std::memcpy(mine, src + off, len); },
        [&](const char* const* slots) {
          for (int q = 0; q < s.size(); ++q) std::memcpy(dst + q * bytes + off, slots[q], len);
        },
        "all_gather", impl.timeout);
  }
  return out;
}

// Each rank's slot holds, per destination rank d, the piece of d's chunk (dim 0's d-th share)
// at d · (slot / size) bytes.
at::Tensor shared_reduce_scatter(const Comm::Impl& impl, const at::Tensor& t) {
  RECORD_FUNCTION("weft::shm reduce_scatter_sum", std::vector<c10::IValue>({t}));
  SharedSlots& s = *impl.shm;
  const at::Tensor in = t.contiguous();
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] /= s.size();
  at::Tensor out = torch::empty(shape, in.options());
  at::Tensor flat = out.view({-1});
  const size_t es = in.element_size();
  const int64_t chunk = out.numel();
  const size_t share = s.slot_bytes() / static_cast<size_t>(s.size()) / 64 * 64;
  const int64_t per = static_cast<int64_t>(share / es);
  WEFT_ASSERT(per > 0, "reduce_scatter_sum: slots of ", s.slot_bytes(), " bytes for ", s.size(),
              " ranks");
  const char* src = static_cast<const char*>(in.data_ptr());
  const uint64_t what = what_of(SharedOp::kScatter, in.scalar_type(), in.numel());
  for (int64_t off = 0; off < chunk; off += per) {
    const int64_t len = std::min(per, chunk - off);
    s.exchange(
        what,
        [&](char* mine) {
          for (int d = 0; d < s.size(); ++d)
            std::memcpy(mine + d * share, src + (d * chunk + off) * es, len * es);
        },
        [&](const char* const* slots) {
          sum_slots(flat.narrow(0, off, len), slots, s.size(), s.rank() * share);
        },
        "reduce_scatter_sum", impl.timeout);
  }
  return out;
}

// reduce_scatter_sum's contract: rank r keeps chunk r of dim 0.
void check_scatter_rows(const at::Tensor& t, int size) {
  WEFT_CHECK(t.dim() > 0 && t.size(0) % size == 0, "reduce_scatter_sum: dim 0 (",
             t.dim() ? t.size(0) : 0, ") must be divisible by the group size ", size);
}

// The collective `op` of a device tensor, in place, through a host copy (Impl::staged).
template <typename Op>
void through_host(at::Tensor& t, const Op& op) {
  at::Tensor h = t.to(at::kCPU).contiguous();
  op(h);
  t.copy_(h);
}
}  // namespace

void Comm::all_reduce_sum(at::Tensor& t) const {
  if (size() > 1 && impl_->shared(t))
    return blocked([&] { shared_all_reduce(*impl_, t, false, "all_reduce_sum"); });
  all_reduce_sum_async(t).wait();
}

Pending Comm::all_reduce_sum_async(at::Tensor& t) const {
  if (size() == 1) return {};
  WEFT_CHECK(t.is_contiguous(), "all_reduce_sum: tensor must be contiguous");
  if (impl_->staged(t) || needs_fp32(t)) {  // reduced in a host / fp32 copy, copied back at wait
    at::Tensor h = t.to(at::kCPU);
    if (needs_fp32(h)) h = h.to(at::kFloat);
    Pending inner = all_reduce_sum_async(h);
    at::Tensor dst = t;
    return Pending([inner, h, dst]() mutable {
      inner.wait();
      dst.copy_(h);
    });
  }
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  c10::intrusive_ptr<c10d::Work> work = impl_->group_for(t).allreduce(v, opts);
  std::shared_ptr<Impl> impl = impl_;
  return Pending([impl, work] { impl->wait(work, "all_reduce_sum"); });
}

void Comm::all_reduce_max(at::Tensor& t) const {
  if (size() == 1) return;
  if (impl_->shared(t))
    return blocked([&] { shared_all_reduce(*impl_, t, true, "all_reduce_max"); });
  if (impl_->staged(t)) return through_host(t, [&](at::Tensor& h) { all_reduce_max(h); });
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  impl_->wait(impl_->group_for(t).allreduce(v, opts), "all_reduce_max");
}

void Comm::broadcast(at::Tensor& t, int root) const {
  if (size() == 1) return;
  if (impl_->staged(t)) return through_host(t, [&](at::Tensor& h) { broadcast(h, root); });
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  impl_->wait(impl_->group_for(t).broadcast(v, opts), "broadcast");
}

at::Tensor Comm::all_gather(const at::Tensor& t) const {
  if (size() > 1 && impl_->shared(t)) return blocked([&] { return shared_all_gather(*impl_, t); });
  return all_gather_async(t).wait();
}

PendingTensor Comm::all_gather_async(const at::Tensor& t) const {
  if (size() == 1) return PendingTensor(t.clone());
  if (impl_->staged(t)) {  // gathered in a host copy
    auto inner = std::make_shared<PendingTensor>(all_gather_async(t.to(at::kCPU)));
    const at::TensorOptions back = t.options();
    return PendingTensor([inner, back] { return inner->wait().to(back); });
  }
#ifdef WEFT_CUDA
  if (t.is_cuda()) {  // NCCL's all-gather into one buffer: no per-rank outputs to concatenate
    at::Tensor in = t.dim() == 0 ? t.reshape({1}) : t.contiguous();
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] *= size();
    at::Tensor out = torch::empty(shape, in.options());
    c10::intrusive_ptr<c10d::Work> work = impl_->group_for(t)._allgather_base(out, in);
    std::shared_ptr<Impl> impl = impl_;
    return PendingTensor([impl, work, in, out] {  // `in` lives until the collective is done
      impl->wait(work, "all_gather");
      return out;
    });
  }
#endif
  if (needs_fp32(t)) {
    // Nothing is summed: 2-byte floats (bf16, which 1.13's Gloo does not know, and half) go as
    // rows of bytes, not through an fp32 copy of twice the size.
    const at::Tensor rows = t.dim() == 0 ? t.reshape({1}) : t.contiguous();
    int64_t row_elements = 1;
    for (int64_t d = 1; d < rows.dim(); ++d) row_elements *= rows.size(d);
    auto inner = std::make_shared<PendingTensor>(
        all_gather_async(rows.view({rows.size(0), row_elements}).view(at::kByte)));
    std::vector<int64_t> shape = rows.sizes().vec();
    shape[0] = rows.size(0) * size();
    const at::ScalarType type = t.scalar_type();
    return PendingTensor([inner, type, shape] { return inner->wait().view(type).view(shape); });
  }
  std::vector<at::Tensor> in{t.contiguous()};
  auto out = std::make_shared<std::vector<std::vector<at::Tensor>>>(1);
  for (int r = 0; r < size(); ++r) (*out)[0].push_back(torch::empty_like(in[0]));
  c10::intrusive_ptr<c10d::Work> work = impl_->group_for(t).allgather(*out, in);
  std::shared_ptr<Impl> impl = impl_;
  return PendingTensor([impl, work, out] {
    impl->wait(work, "all_gather");
    return torch::cat((*out)[0], 0);
  });
}

std::vector<std::string> Comm::all_gather_strings(const std::string& s) const {
  if (size() == 1) return {s};
  at::Tensor lens = all_gather(torch::tensor({static_cast<int64_t>(s.size())}, torch::kLong));
  const int64_t most = std::max<int64_t>(lens.max().item<int64_t>(), 1);
  at::Tensor bytes = torch::zeros({most}, torch::kByte);
  std::memcpy(bytes.data_ptr(), s.data(), s.size());
  at::Tensor all = all_gather(bytes).view({size(), most});
  std::vector<std::string> out;
  for (int r = 0; r < size(); ++r)
    out.emplace_back(static_cast<const char*>(all[r].data_ptr()),
                     static_cast<size_t>(lens[r].item<int64_t>()));
  return out;
}

at::Tensor Comm::reduce_scatter_sum(const at::Tensor& t) const {
  if (size() > 1 && impl_->shared(t)) {
    check_scatter_rows(t, size());
    return blocked([&] { return shared_reduce_scatter(*impl_, t); });
  }
  return reduce_scatter_sum_async(t).wait();
}

PendingTensor Comm::reduce_scatter_sum_async(const at::Tensor& t) const {
  check_scatter_rows(t, size());
  if (size() == 1) return PendingTensor(t.clone());
  std::shared_ptr<Impl> impl = impl_;
  if (impl_->staged(t)) {
    auto inner = std::make_shared<PendingTensor>(reduce_scatter_sum_async(t.to(at::kCPU)));
    const c10::Device device = t.device();
    return PendingTensor([inner, device] { return inner->wait().to(device); });
  }
#ifdef WEFT_CUDA
  if (t.is_cuda()) {  // NCCL's own reduce-scatter
    at::Tensor in = t.contiguous();
    std::vector<int64_t> shape = in.sizes().vec();
    shape[0] /= size();
    at::Tensor out = torch::empty(shape, in.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    c10::intrusive_ptr<c10d::Work> work = impl_->group_for(t)._reduce_scatter_base(out, in, opts);
    return PendingTensor([impl, work, in, out] {  // `in` lives until the collective is done
      impl->wait(work, "reduce_scatter_sum");
      return out;
    });
  }
#endif
  // Gloo on 1.13 has no reduce_scatter: an all-to-all brings chunk r of every rank to rank r,
  // which sums them locally (the same bytes on the wire as a ring reduce-scatter).
  at::Tensor in = needs_fp32(t) ? t.to(at::kFloat).contiguous() : t.contiguous();
  at::Tensor out = torch::empty_like(in);
  std::vector<int64_t> splits;  // even splits
  c10::intrusive_ptr<c10d::Work> work = impl_->group_for(in).alltoall_base(out, in, splits, splits);
  std::vector<int64_t> shape = out.sizes().vec();
  shape[0] /= size();
  shape.insert(shape.begin(), size());
  const at::ScalarType type = t.scalar_type();
  return PendingTensor([impl, work, in, out, shape, type] {
    impl->wait(work, "reduce_scatter_sum");
    return out.view(shape).sum(0).to(type);
  });
}

bool Comm::reduce_scatter_buffers_whole(const at::Tensor& t) const {
  if (size() == 1) return false;
#ifdef WEFT_CUDA
  if (t.is_cuda() && !impl_->staged(t)) return false;
#endif
  return true;
}

at::Tensor Comm::all_to_all(const at::Tensor& t, const std::vector<int64_t>& send_counts,
                            const std::vector<int64_t>& recv_counts) const {
  const size_t n = static_cast<size_t>(size());
  WEFT_CHECK(t.dim() > 0 && send_counts.size() == n && recv_counts.size() == n,
             "all_to_all: one send and one receive count per rank of a group of ", n);
  int64_t sent = 0, received = 0;
  for (size_t r = 0; r < n; ++r) sent += send_counts[r], received += recv_counts[r];
  WEFT_CHECK(sent == t.size(0), "all_to_all: send counts add up to ", sent,
             " rows, the tensor has ", t.size(0));
  if (size() == 1) return t.clone();
  if (impl_->staged(t)) return all_to_all(t.to(at::kCPU), send_counts, recv_counts).to(t.device());
  // Gloo moves bytes: 2-byte elements (bf16, which 1.13's Gloo does not know, and half; its
  // all-to-all has no int16 either) go as rows of bytes. NCCL moves bf16 as it is.
  const bool as_bytes = t.element_size() == 2 && !t.is_cuda();
  at::Tensor in = t.contiguous();
  int64_t row_elements = 1;
  for (int64_t d = 1; d < t.dim(); ++d) row_elements *= t.size(d);
  if (as_bytes) in = in.view({t.size(0), row_elements}).view(at::kByte);
  std::vector<int64_t> shape = in.sizes().vec();
  shape[0] = received;
  at::Tensor out = torch::empty(shape, in.options());
  std::vector<int64_t> in_splits = send_counts, out_splits = recv_counts;
  impl_->wait(impl_->group_for(in).alltoall_base(out, in, out_splits, in_splits), "all_to_all");
  if (!as_bytes) return out;
  std::vector<int64_t> full = t.sizes().vec();
  full[0] = received;
  return out.view(t.scalar_type()).view(full);
}

Pending Comm::send(const at::Tensor& t, int dst, int tag) const {
  WEFT_CHECK(dst >= 0 && dst < size() && dst != rank(), "send: rank ", rank(),
             " cannot send to rank ", dst, " of a group of ", size());
  // Device tensors go through host memory over Gloo (tag-matched; see Impl::device).
  std::vector<at::Tensor> v{t.to(at::kCPU).contiguous()};
  std::shared_ptr<Impl> impl = impl_;
  if (impl->messages) {
    Pending sent = impl->messages->send(v[0], dst, tag);
    return Pending([impl, sent]() mutable { sent.wait(); });
  }
  c10::intrusive_ptr<c10d::Work> work = impl_->group_for(v[0]).send(v, dst, tag);
  return Pending([impl, work, v] { impl->wait(work, "send"); });
}

void Comm::recv(at::Tensor& t, int src, int tag) const { irecv(t, src, tag).wait(); }

Pending Comm::irecv(at::Tensor& t, int src, int tag) const {
  WEFT_CHECK(src >= 0 && src < size() && src != rank(), "recv: rank ", rank(),
             " cannot receive from rank ", src, " of a group of ", size());
  WEFT_CHECK(t.is_contiguous(), "recv: tensor must be contiguous");
  // Device tensors arrive in host memory (see send) and are copied over when waited.
  std::vector<at::Tensor> v{t.is_cuda() ? torch::empty(t.sizes(), t.options().device(at::kCPU))
                                        : t};
  std::shared_ptr<Impl> impl = impl_;
  if (impl->messages) {
    Pending received = impl->messages->irecv(v[0], src, tag);
    return Pending([impl, received, v, t]() mutable {
      received.wait();
      if (t.is_cuda()) t.copy_(v[0]);
    });
  }
  c10::intrusive_ptr<c10d::Work> work = impl_->group_for(v[0]).recv(v, src, tag);
  return Pending([impl, work, v, t]() mutable {
    impl->wait(work, "recv");
    if (t.is_cuda()) t.copy_(v[0]);
  });
}

void Comm::barrier() const {
  if (size() == 1) return;
  impl_->wait(impl_->pg->barrier(), "barrier");  // Gloo: NCCL's barrier only orders a stream
}

}  // namespace weft::dist
