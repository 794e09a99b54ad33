// CP split quality: for several sequence mixes and cp sizes, the makespan (slowest rank's work)
// of each policy divided by the ideal total/cp, and balanced/lpt. Work is the exact model of
// plan/cp_split.h, priced two ways: attention pairs only, and forward FLOPs of a Llama-2-7B-like
// LLM (attention pairs plus the per-token linear work). No timings: every figure is a ratio of
// quantities computed in the same run.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "weft/plan/cp_split.h"

namespace {

using weft::plan::CpCostModel;
using weft::plan::CpPolicy;
using weft::plan::SequenceDesc;
using weft::plan::Span;

struct Mix {
  std::string name;
  SequenceDesc seq;
};

constexpr int64_t kImage = 576;  // tokens per image (LLaVA-1.5, 336px / 14)

// One document: text segments of random length between `images` images, starting with text.
void add_interleaved(std::mt19937_64& rng, int64_t begin, int64_t end, int64_t images,
                     std::vector<Span>& spans) {
  const int64_t text = end - begin - images * kImage;
  std::vector<int64_t> cuts;
  for (int64_t i = 0; i < images; ++i)
    cuts.push_back(std::uniform_int_distribution<int64_t>(0, text)(rng));
  std::sort(cuts.begin(), cuts.end());
  for (int64_t i = 0; i < images; ++i) {
    const int64_t b = begin + cuts[static_cast<size_t>(i)] + i * kImage;
    spans.push_back({b, b + kImage});
  }
}

std::vector<Mix> mixes() {
  std::mt19937_64 rng(2024);
  std::vector<Mix> m;
  m.push_back({"text-8k (causal)", weft::plan::make_sequence(8192, {})});
  {  // 8 images interleaved with text in one 8k document
    std::vector<Span> spans;
    add_interleaved(rng, 0, 8192, 8, spans);
    m.push_back({"8 images interleaved 8k", weft::plan::make_sequence(8192, spans)});
  }
  {  // 4 images first, then a long answer
    std::vector<Span> spans;
    for (int64_t i = 0; i < 4; ++i) spans.push_back({16 + i * kImage, 16 + (i + 1) * kImage});
    m.push_back({"4 images then text 8k", weft::plan::make_sequence(8192, spans)});
  }
  {  // packed documents, about half with one image, padded at the end
    std::vector<Span> spans;
    std::vector<int64_t> starts;
    int64_t p = 0;
    while (true) {
      const int64_t len = std::uniform_int_distribution<int64_t>(300, 2000)(rng);
      if (p + len > 8000) break;
      starts.push_back(p);
      if (len > kImage + 16 && std::uniform_int_distribution<int>(0, 1)(rng))
        add_interleaved(rng, p, p + len, 1, spans);
      p += len;
    }
    m.push_back({"packed docs 8k (+padding)", weft::plan::make_sequence(8192, spans, starts, p)});
  }
  {  // short: one image in a 2k document, 16 blocks (exact search for cp <= 4)
    std::vector<Span> spans;
    add_interleaved(rng, 0, 2048, 1, spans);
    m.push_back({"1 image + text 2k", weft::plan::make_sequence(2048, spans)});
  }
  {  // video-like: 40 frames of 576 tokens with captions, one 32k document
    std::vector<Span> spans;
    add_interleaved(rng, 0, 32768, 40, spans);
    m.push_back({"40 frames interleaved 32k", weft::plan::make_sequence(32768, spans)});
  }
  return m;
}

void table(const char* title, const CpCostModel& cost, const std::vector<Mix>& all) {
  std::printf("\n%s\n", title);
  std::printf("%-27s %6s %3s %11s %7s %7s %9s %12s\n", "mix", "blocks", "cp", "contiguous",
              "zigzag", "lpt", "balanced", "balanced/lpt");
  for (const Mix& mix : all) {
    for (int64_t cp : {2, 4, 8}) {
      weft::plan::CpSplitOptions o;
      o.cp = cp;
      o.block_size = 128;
      o.cost = cost;
      double ratio[4], lpt = 0, bal = 0;
      for (CpPolicy p : weft::plan::all_cp_policies()) {
        o.policy = p;
        const weft::plan::CpSplit s = weft::plan::split_sequence(mix.seq, o);
        ratio[static_cast<int>(p)] = s.makespan() / s.ideal();
        if (p == CpPolicy::kLpt) lpt = s.makespan();
        if (p == CpPolicy::kBalanced) bal = s.makespan();
      }
      std::printf("%-27s %6lld %3lld %11.4f %7.4f %7.4f %9.4f %12.4f\n", mix.name.c_str(),
                  static_cast<long long>((mix.seq.size() + 127) / 128), static_cast<long long>(cp),
                  ratio[0], ratio[1], ratio[2], ratio[3], bal / lpt);
    }
  }
}

}  // namespace

int main() {
  const std::vector<Mix> all = mixes();
  std::printf(
      "makespan / ideal (total/cp) per policy, block size 128; balanced/lpt < 1 = better\n");
  table("work = visible attention pairs", CpCostModel{1.0, 0.0}, all);
  weft::LlmSpec llama;  // Llama-2-7B shape
  llama.hidden = 4096, llama.heads = 32, llama.kv_heads = 32, llama.ffn = 11008;
  llama.layers = 32, llama.vocab = 32000;
  table("work = forward FLOPs of a Llama-2-7B-like LLM (attention + linear)",
        weft::plan::make_cp_cost_model(llama), all);
  return 0;
}
