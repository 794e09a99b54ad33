#include "weft/plan/cluster.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "weft/core/error.h"
#include "weft/core/toml.h"

namespace weft::plan {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Numbers from vendor data sheets (H100/H200 SXM) and REFERENCES.md (this machine). The
// matmul efficiency is what large bf16 GEMMs reach in practice; measure with `weft bench
// profile` and override it in the cluster file.
std::vector<DeviceProfile> shipped_profiles() {
  DeviceProfile h100;
  h100.name = "h100";
  h100.peak_bf16_flops = 989e12;
  h100.peak_fp32_flops = 67e12;  // fp32 without TF32 (PyTorch's default for matmuls)
  h100.memory_bytes = 80 * kGiB;
  h100.hbm_bytes_per_second = 3.35e12;
  h100.matmul_efficiency = 0.7;
  DeviceProfile h200 = h100;
  h200.name = "h200";
  h200.memory_bytes = 140 * kGiB;
  h200.hbm_bytes_per_second = 4.8e12;
  // One core of the 2-core development machine (a rank of a 2-process run has one core):
  // placeholder peaks — bf16 matmul measured at 0.5-1.1 TFLOP/s and bf16 Linear forward +
  // backward at 0.35-0.39 TFLOP/s on both cores (so 0.25e12 peak at 0.7 efficiency per core);
  // fp32 ~35 GFLOP/s with OpenBLAS on both cores. Measure with `weft bench profile`.
  DeviceProfile cpu;
  cpu.name = "cpu-core";
  cpu.peak_bf16_flops = 0.25e12;
  cpu.peak_fp32_flops = 17.5e9;
  cpu.memory_bytes = 11 * kGiB;
  cpu.hbm_bytes_per_second = 10e9;
  cpu.matmul_efficiency = 0.7;
  return {h100, h200, cpu};
}

// "a, b, c" of quoted names.
std::string quoted_list(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "\"" : ", \"") + n + "\"";
  return out;
}

std::string describe(const toml::node& n) {
  std::ostringstream os;
  if (const auto* s = n.as_string()) return "\"" + s->get() + "\"";
  if (n.is_table()) return "{...}";
  if (n.is_array()) return "[...]";
  n.visit([&](const auto& x) { os << x; });
  return os.str();
}

// One TOML table of the cluster file; every message names the file and the full key.
class Reader {
 public:
  Reader(const std::string& source, const toml::table& t, std::string path)
      : source_(source), table_(t), path_(std::move(path)) {}

  std::string key(std::string_view k) const {
    return path_.empty() ? std::string(k) : path_ + "." + std::string(k);
  }
  const toml::node* find(std::string_view k) const { return table_.get(k); }
  [[noreturn]] void fail(std::string_view k, const std::string& what) const {
    const toml::node* n = find(k);
    if (!n || n->is_table()) WEFT_FAIL(source_, ": ", key(k), ": ", what);
    WEFT_FAIL(source_, ": ", key(k), " = ", describe(*n), ": ", what);
  }
  void only(std::initializer_list<std::string_view> allowed) const {
    std::string names;
    for (auto a : allowed) names += (names.empty() ? "" : ", ") + std::string(a);
    for (auto&& [k, node] : table_)
      if (std::find(allowed.begin(), allowed.end(), k.str()) == allowed.end())
        fail(k.str(), std::string(node.is_table() ? "unknown table" : "unknown key") +
                          " (allowed: " + names + ")");
  }
  // A number > 0 (>= 0 when `zero_ok`); false when absent and not `required`.
  bool number(std::string_view k, double* out, bool required, bool zero_ok = false) const {
    const toml::node* n = find(k);
    if (!n) {
      WEFT_CHECK(!required, source_, ": ", key(k), ": missing (expected a number)");
      return false;
    }
    double v = 0;
    if (const auto* i = n->as_integer()) {
      v = static_cast<double>(i->get());
    } else if (const auto* f = n->as_floating_point()) {
      v = f->get();
    } else {
      fail(k, "expected a number");
    }
    if (!std::isfinite(v) || v < 0 || (v == 0 && !zero_ok))
      fail(k, zero_ok ? "must be a finite number >= 0" : "must be a finite number > 0");
    *out = v;
    return true;
  }
  int64_t count(std::string_view k) const {
    const toml::node* n = find(k);
    WEFT_CHECK(n, source_, ": ", key(k), ": missing (expected an integer >= 1)");
    const auto* i = n->as_integer();
    if (!i) fail(k, "expected an integer >= 1");
    if (i->get() < 1) fail(k, "must be >= 1");
    return i->get();
  }
  const toml::table* table(std::string_view k) const {
    const toml::node* n = find(k);
    if (n && !n->is_table()) fail(k, "expected a table");
    return n ? n->as_table() : nullptr;
  }

 private:
  const std::string& source_;
  const toml::table& table_;
  std::string path_;
};

DeviceProfile read_device(const std::string& source, const toml::node& node) {
  const auto names = device_profile_names();
  const auto lookup = [&](const std::string& name, const std::string& key) {
    if (std::find(names.begin(), names.end(), name) != names.end()) return device_profile(name);
    WEFT_FAIL(source, ": ", key, " = \"", name,
              "\": unknown device profile (shipped: ", quoted_list(names),
              "; or give an inline [device] table)");
  };
  if (const auto* s = node.as_string()) return lookup(s->get(), "device");
  const toml::table* t = node.as_table();
  WEFT_CHECK(t, source, ": device = ", describe(node), ": expected a profile name (",
             quoted_list(names), ") or a table");
  Reader r(source, *t, "device");
  r.only({"base", "name", "bf16_tflops", "fp32_tflops", "memory_gib", "hbm_gbs",
          "matmul_efficiency", "block_overhead_us", "reserved_gib"});
  DeviceProfile d;
  const bool based = r.find("base") != nullptr;
  if (based) {
    const auto* base = r.find("base")->as_string();
    if (!base) r.fail("base", "expected a profile name (" + quoted_list(names) + ")");
    d = lookup(base->get(), "device.base");
  }
  if (const toml::node* n = r.find("name")) {
    if (!n->as_string()) r.fail("name", "expected a string");
    d.name = n->as_string()->get();
  }
  WEFT_CHECK(!d.name.empty(), source, ": device.name: missing (a table without base needs a name)");
  double tflops = 0, gib = 0, gbs = 0;
  if (r.number("bf16_tflops", &tflops, !based)) d.peak_bf16_flops = tflops * 1e12;
  // Without a base and an fp32 figure, fp32 runs are charged at the bf16 rate.
  if (!based) d.peak_fp32_flops = d.peak_bf16_flops;
  if (r.number("fp32_tflops", &tflops, false)) d.peak_fp32_flops = tflops * 1e12;
  if (r.number("memory_gib", &gib, !based)) d.memory_bytes = gib * kGiB;
  if (r.number("hbm_gbs", &gbs, false, true)) d.hbm_bytes_per_second = gbs * 1e9;
  double eff = 0;
  if (r.number("matmul_efficiency", &eff, false)) {
    if (eff > 1) r.fail("matmul_efficiency", "must be in (0, 1] (a fraction of the peak)");
    d.matmul_efficiency = eff;
  }
  double us = 0;
  if (r.number("block_overhead_us", &us, false, true)) d.block_overhead_seconds = us * 1e-6;
  if (r.number("reserved_gib", &gib, false, true)) {
    if (gib * kGiB >= d.memory_bytes) {
      std::ostringstream memory;
      memory << d.memory_bytes / kGiB;
      r.fail("reserved_gib", "must be less than the device's memory (" + memory.str() + " GiB)");
    }
    d.reserved_bytes = gib * kGiB;
  }
  return d;
}

Link read_link(const Reader& top, const std::string& source, std::string_view key) {
  const toml::table* t = top.table(key);
  WEFT_CHECK(t, source, ": [", key, "]: missing table (expected bandwidth_gbs and latency_us)");
  Reader r(source, *t, std::string(key));
  r.only({"bandwidth_gbs", "latency_us"});
  double gbs = 0, us = 0;
  r.number("bandwidth_gbs", &gbs, true);
  r.number("latency_us", &us, true, true);
  return {gbs * 1e9, us * 1e-6};
}

// Ring/tree step counts.
double steps_log2(double n) { return std::ceil(std::log2(n)); }

}  // namespace

std::vector<std::string> device_profile_names() {
  std::vector<std::string> names;
  for (const auto& p : shipped_profiles()) names.push_back(p.name);
  return names;
}

DeviceProfile device_profile(const std::string& name) {
  for (const auto& p : shipped_profiles())
    if (p.name == name) return p;
  WEFT_FAIL("unknown device profile \"", name, "\" (shipped: ", quoted_list(device_profile_names()),
            ")");
}

Cluster parse_cluster(const std::string& text, const std::string& source) {
  const toml::table root = parse_toml(text, source);
  Cluster c;
  c.source = source;
  Reader r(c.source, root, "");
  r.only({"nodes", "gpus_per_node", "device", "intra_node", "inter_node", "shared_memory"});
  c.nodes = r.count("nodes");
  c.gpus_per_node = r.count("gpus_per_node");
  const toml::node* device = r.find("device");
  WEFT_CHECK(device, source,
             ": device: missing (a profile name: ", quoted_list(device_profile_names()),
             ", or a [device] table)");
  c.device = read_device(c.source, *device);
  c.intra_node = read_link(r, c.source, "intra_node");
  if (c.nodes > 1 || r.find("inter_node")) {
    c.inter_node = read_link(r, c.source, "inter_node");
  } else {
    c.inter_node = c.intra_node;  // one node: never used
  }
  if (r.find("shared_memory")) c.shared_memory = read_link(r, c.source, "shared_memory");
  return c;
}

Cluster load_cluster(const std::string& path) {
  std::ifstream in(path);
  WEFT_CHECK(in, path, ": cannot read cluster file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_cluster(text.str(), path);
}

std::string to_json(const Cluster& c) {
  nlohmann::ordered_json j;
  j["nodes"] = c.nodes;
  j["gpus_per_node"] = c.gpus_per_node;
  const DeviceProfile& d = c.device;
  j["device"] = {{"name", d.name},
                 {"peak_bf16_flops", d.peak_bf16_flops},
                 {"peak_fp32_flops", d.peak_fp32_flops},
                 {"memory_bytes", d.memory_bytes},
                 {"reserved_bytes", d.reserved_bytes},
                 {"hbm_bytes_per_second", d.hbm_bytes_per_second},
                 {"matmul_efficiency", d.matmul_efficiency},
                 {"block_overhead_seconds", d.block_overhead_seconds}};
  j["intra_node"] = {{"bytes_per_second", c.intra_node.bytes_per_second},
                     {"latency_seconds", c.intra_node.latency_seconds}};
  j["inter_node"] = {{"bytes_per_second", c.inter_node.bytes_per_second},
                     {"latency_seconds", c.inter_node.latency_seconds}};
  if (c.shared_memory.bytes_per_second > 0)
    j["shared_memory"] = {{"bytes_per_second", c.shared_memory.bytes_per_second},
                          {"latency_seconds", c.shared_memory.latency_seconds}};
  return j.dump(2);
}

const Link& bottleneck_link(const Cluster& c, const std::vector<int64_t>& ranks) {
  for (int64_t r : ranks)
    if (c.node_of(r) != c.node_of(ranks.front())) return c.inter_node;
  return c.intra_node;
}

double p2p_seconds(const Cluster& c, int64_t src, int64_t dst, double bytes) {
  if (src == dst || bytes <= 0) return 0;
  return (c.node_of(src) == c.node_of(dst) ? c.intra_node : c.inter_node).seconds(bytes);
}

double all_reduce_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes,
                          CollectiveAlgo algo) {
  const double n = static_cast<double>(ranks.size());
  if (n <= 1) return 0;
  const Link& l = bottleneck_link(c, ranks);
  if (algo == CollectiveAlgo::kTree)
    return 2 * steps_log2(n) * l.latency_seconds + 2 * bytes / l.bytes_per_second;
  return 2 * (n - 1) * l.latency_seconds + 2 * (n - 1) / n * bytes / l.bytes_per_second;
}

double all_gather_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes) {
  const double n = static_cast<double>(ranks.size());
  if (n <= 1) return 0;
  const Link& l = bottleneck_link(c, ranks);
  return (n - 1) * l.latency_seconds + (n - 1) / n * bytes / l.bytes_per_second;
}

double all_to_all_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes) {
  // Pairwise exchange: n - 1 rounds, each rank sending 1/n of its rows to one peer per round.
  return all_gather_seconds(c, ranks, bytes);
}

double reduce_scatter_seconds(const Cluster& c, const std::vector<int64_t>& ranks, double bytes) {
  return all_gather_seconds(c, ranks, bytes);  // the same ring, run the other way
}

bool shared_memory_collectives(const Spec& spec, const Cluster& c) {
  return spec.train.shared_memory_collectives && c.shared_memory.bytes_per_second > 0;
}

double blocking_collective_seconds(const Spec& spec, const Cluster& c,
                                   const std::vector<int64_t>& ranks, CollectiveKind kind,
                                   double bytes) {
  const double n = static_cast<double>(ranks.size());
  if (n <= 1) return 0;
  if (!shared_memory_collectives(spec, c) || &bottleneck_link(c, ranks) != &c.intra_node) {
    return kind == CollectiveKind::kAllReduce ? all_reduce_seconds(c, ranks, bytes)
                                              : all_gather_seconds(c, ranks, bytes);
  }
  const double copied = kind == CollectiveKind::kAllReduce   ? (n + 1) * bytes
                        : kind == CollectiveKind::kAllGather ? (n + 1) / n * bytes
                                                             : 2 * bytes;
  return c.shared_memory.seconds(copied);
}

bool shared_memory_messages(const Spec& spec, const Cluster& c) {
  return shared_memory_collectives(spec, c) && spec.train.shared_memory_messages;
}

double message_seconds(const Spec& spec, const Cluster& c, int64_t src, int64_t dst, double bytes) {
  if (src == dst || bytes <= 0) return 0;
  if (!shared_memory_messages(spec, c) || c.node_of(src) != c.node_of(dst))
    return p2p_seconds(c, src, dst, bytes);
  return c.shared_memory.seconds(bytes);
}

}  // namespace weft::plan
