#include "weft/model/mask.h"

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <utility>

#include "weft/core/error.h"

namespace weft::model {

at::Tensor visible_mask(const at::Tensor& doc, const at::Tensor& item) {
  const int64_t S = doc.size(1);
  at::Tensor pos = torch::arange(S, doc.options().dtype(torch::kLong));
  at::Tensor causal = pos.view({S, 1}) >= pos.view({1, S});  // [S, S]: k <= q
  at::Tensor self = pos.view({S, 1}) == pos.view({1, S});
  at::Tensor dq = doc.unsqueeze(2), dk = doc.unsqueeze(1);
  at::Tensor iq = item.unsqueeze(2), ik = item.unsqueeze(1);
  at::Tensor same_doc = (dq == dk) & (dq >= 0);
  at::Tensor same_item = (iq == ik) & (iq >= 0);
  return ((same_doc & (causal | same_item)) | self).unsqueeze(1);
}

std::vector<AttentionChunk> attention_chunks(const at::Tensor& doc_in, const at::Tensor& item_in,
                                             int64_t chunk, double most) {
  WEFT_ASSERT(chunk > 0 && doc_in.dim() == 2 && doc_in.sizes() == item_in.sizes());
  const int64_t B = doc_in.size(0), S = doc_in.size(1);
  const at::Tensor doc = doc_in.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor item = item_in.to(at::kCPU, at::kLong).contiguous();
  const int64_t* dp = doc.data_ptr<int64_t>();
  const int64_t* ip = item.data_ptr<int64_t>();
  // Per row and query, the keys it sees: one span [lo, hi) when documents and items are
  // contiguous (a document's start to the query, or to its item's end if that is later).
  std::vector<int64_t> lo(static_cast<size_t>(B * S)), hi(static_cast<size_t>(B * S));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* d = dp + b * S;
    const int64_t* it = ip + b * S;
    std::map<int64_t, std::pair<int64_t, int64_t>> docs;  // first and last position
    std::map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>> items;  // (doc, item)
    auto extend = [](auto& spans, const auto& key, int64_t s) {
      auto [span, fresh] = spans.emplace(key, std::make_pair(s, s));
      if (fresh) return true;
      if (span->second.second != s - 1) return false;  // resumed after something else
      span->second.second = s;
      return true;
    };
    for (int64_t s = 0; s < S; ++s) {
      if (d[s] < 0) continue;
      if (!extend(docs, d[s], s)) return {};
      if (it[s] >= 0 && !extend(items, std::make_pair(d[s], it[s]), s)) return {};
    }
    for (int64_t s = 0; s < S; ++s) {
      const size_t at = static_cast<size_t>(b * S + s);
      lo[at] = s;  // padding sees itself alone
      hi[at] = s + 1;
      if (d[s] < 0) continue;
      lo[at] = docs.at(d[s]).first;
      if (it[s] >= 0) hi[at] = std::max(hi[at], items.at({d[s], it[s]}).second + 1);
    }
  }
  // Queries whose keys are one pattern in every row: causal from one key (each query sees that
  // key up to itself), or one span of keys for all of them. Runs of such queries become one block
  // whatever its length (images and documents at the same places in every row: no mask at all);
  // the rest go in blocks of at most `chunk`, with the runs shorter than min_run: a quarter of a
  // block (the kernels work in tiles of 64-128 queries, and a call per short run would cost more
  // than the masked scores it saves: 24-token images every 48 tokens stay in blocks of `chunk`),
  // at least 16, at most `chunk`.
  const int64_t min_run = std::min<int64_t>(chunk, std::max<int64_t>(16, chunk / 4));
  enum class Run { kCausal, kSpan, kMixed };
  struct Group {
    int64_t q0, q1;
    Run run;
    int64_t lo, hi;  // kCausal: lo; kSpan: [lo, hi)
  };
  std::vector<Group> groups;
  for (int64_t s = 0; s < S; ++s) {
    bool same_lo = true, same_hi = true, causal = true;
    for (int64_t b = 0; b < B; ++b) {
      const size_t at = static_cast<size_t>(b * S + s);
      same_lo = same_lo && lo[at] == lo[static_cast<size_t>(s)];
      same_hi = same_hi && hi[at] == hi[static_cast<size_t>(s)];
      causal = causal && hi[at] == s + 1;
    }
    const int64_t l = lo[static_cast<size_t>(s)], h = hi[static_cast<size_t>(s)];
    const Run run = same_lo && causal    ? Run::kCausal
                    : same_lo && same_hi ? Run::kSpan
                                         : Run::kMixed;
    if (!groups.empty()) {
      Group& g = groups.back();
      const bool extends =
          g.run == run && (run == Run::kMixed || (g.lo == l && (run == Run::kCausal || g.hi == h)));
      if (extends) {
        g.q1 = s + 1;
        continue;
      }
    }
    groups.push_back({s, s + 1, run, l, h});
  }
  // Short runs join the mixed queries; mixed queries go in blocks of `chunk`.
  std::vector<Group> blocks;
  for (Group g : groups) {
    if (g.run != Run::kMixed && g.q1 - g.q0 < min_run) g.run = Run::kMixed;
    if (g.run == Run::kMixed && !blocks.empty() && blocks.back().run == Run::kMixed) {
      Group& last = blocks.back();
      const int64_t room = chunk - (last.q1 - last.q0);
      const int64_t take = std::min(room, g.q1 - g.q0);
      last.q1 += take;
      g.q0 += take;
    }
    while (g.q0 < g.q1) {
      Group part = g;
      if (g.run == Run::kMixed) part.q1 = std::min(g.q1, g.q0 + chunk);
      blocks.push_back(part);
      g.q0 = part.q1;
    }
  }
  std::vector<AttentionChunk> chunks;
  double work = 0;
  auto add_tile = [&](AttentionChunk& c, int64_t k0, int64_t k1, TileKind kind) {
    const double area = static_cast<double>(c.q_end - c.q_begin) * static_cast<double>(k1 - k0);
    work += kind == TileKind::kCausal ? area / 2 : area;
    if (!c.tiles.empty() && c.tiles.back().k_end == k0 && c.tiles.back().kind == kind &&
        kind != TileKind::kCausal)
      c.tiles.back().k_end = k1;  // one call for a run of one kind
    else
      c.tiles.push_back({k0, k1, kind});
  };
  for (const Group& g : blocks) {
    AttentionChunk c;
    c.q_begin = g.q0;
    c.q_end = g.q1;
    if (g.run == Run::kCausal) {
      if (g.lo < g.q0) add_tile(c, g.lo, g.q0, TileKind::kAll);
      add_tile(c, g.q0, g.q1, TileKind::kCausal);
    } else if (g.run == Run::kSpan) {
      add_tile(c, g.lo, g.hi, TileKind::kAll);
    } else {
      // Keys in blocks of `chunk` on the grid from 0, the block's own queries as one tile (its
      // diagonal, causal when every row sees exactly up to itself there).
      std::vector<int64_t> cuts = {c.q_begin, c.q_end, S};
      for (int64_t k = 0; k < S; k += chunk)
        if (k < c.q_begin || k > c.q_end) cuts.push_back(k);
      std::sort(cuts.begin(), cuts.end());
      cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
      for (size_t i = 0; i + 1 < cuts.size(); ++i) {
        const int64_t k0 = cuts[i], k1 = cuts[i + 1];
        const bool diagonal = k0 == c.q_begin && k1 == c.q_end;
        bool all = true, none = true, causal = diagonal;
        for (int64_t b = 0; b < B && (all || none || causal); ++b)
          for (int64_t s = c.q_begin; s < c.q_end; ++s) {
            const size_t at = static_cast<size_t>(b * S + s);
            all = all && lo[at] <= k0 && hi[at] >= k1;
            none = none && (hi[at] <= k0 || lo[at] >= k1);
            causal = causal && lo[at] <= k0 && hi[at] == s + 1;
          }
        if (none) continue;
        add_tile(c, k0, k1, all ? TileKind::kAll : causal ? TileKind::kCausal : TileKind::kMasked);
      }
    }
    WEFT_ASSERT(!c.tiles.empty(), "attention_chunks: queries ", c.q_begin, " see no key");
    chunks.push_back(std::move(c));
  }
  if (work > most * static_cast<double>(S) * static_cast<double>(S)) return {};
  return chunks;
}

std::vector<AttentionChunk> join_causal_tiles(const std::vector<AttentionChunk>& chunks) {
  std::vector<AttentionChunk> out;
  for (AttentionChunk c : chunks) {
    std::vector<AttentionTile>& t = c.tiles;
    const size_t n = t.size();
    if (n >= 2 && t[n - 1].kind == TileKind::kCausal && t[n - 2].kind == TileKind::kAll &&
        t[n - 2].k_end == t[n - 1].k_begin) {
      t[n - 2] = {t[n - 2].k_begin, t[n - 1].k_end, TileKind::kCausal};
      t.pop_back();
    }
    auto unmasked = [](const AttentionChunk& x) {
      for (const AttentionTile& tile : x.tiles)
        if (tile.kind == TileKind::kMasked) return false;
      return true;
    };
    auto same_but_causal_end = [](const AttentionChunk& a, const AttentionChunk& b) {
      if (a.tiles.size() != b.tiles.size() || a.tiles.back().kind != TileKind::kCausal ||
          b.tiles.back().kind != TileKind::kCausal ||
          a.tiles.back().k_begin != b.tiles.back().k_begin)
        return false;
      for (size_t i = 0; i + 1 < a.tiles.size(); ++i)
        if (a.tiles[i].k_begin != b.tiles[i].k_begin || a.tiles[i].k_end != b.tiles[i].k_end ||
            a.tiles[i].kind != b.tiles[i].kind)
          return false;
      return true;
    };
    if (!out.empty() && out.back().q_end == c.q_begin && unmasked(out.back()) && unmasked(c) &&
        same_but_causal_end(out.back(), c)) {
      out.back().q_end = c.q_end;
      out.back().tiles.back().k_end = c.q_end;
      continue;
    }
    out.push_back(std::move(c));
  }
  return out;
}

std::string describe(const std::vector<AttentionChunk>& chunks) {
  std::string out;
  for (const AttentionChunk& c : chunks) {
    for (const AttentionTile& t : c.tiles)
      out += std::to_string(t.k_begin) + "-" + std::to_string(t.k_end) +
             "ACM"[static_cast<int>(t.kind)] + " ";
    out += "| ";
  }
  return out;
}

}  // namespace weft::model
