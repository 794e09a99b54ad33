// Batch balance quality (plan/balance.h): for realistic sample mixes on a LLaVA-1.5-7B-like model
// (CLIP ViT-L/14-336 + Llama-2-7B, all trainable), D replicas × M microbatches of 4 samples on
// average, the spread of per-microbatch work under three assignments:
//   in_order   consecutive samples (what weft did before),
//   llm_only   the balancer fed only the LLM's work (encoder weight 0), priced with the full cost,
//   balanced   the balancer on the combined cost.
// Columns: max/mean over all (replica, microbatch) of encoder, LLM and combined work, the combined
// coefficient of variation, the largest microbatch's combined cost (the objective) and the 1F1B
// makespan (P = 4 uniform stages, slowest replica), both relative to in_order's. "balanced" runs
// its microbatches in split order, "+reorder" in order_for_1f1b's; a last line gives reordering
// alone on in_order's split. Every figure is the mean over 20 random batches
// and a ratio of quantities computed in the same run; no timings.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "weft/plan/balance.h"
#include "weft/plan/plan.h"

namespace {

using weft::plan::BalanceCost;
using weft::plan::BalanceOptions;
using weft::plan::BalancePolicy;
using weft::plan::BatchBalance;
using weft::plan::SampleShape;
using weft::plan::SampleWork;

constexpr int64_t kImage = 576;  // tokens per image (336 px / 14)
constexpr int64_t kStages = 4;
constexpr int kBatches = 20;
constexpr int64_t kSamplesPerMicrobatch = 4;

weft::Spec llava_spec() {
  weft::Spec s;
  s.source = "bench";
  weft::LlmSpec& l = s.model.llm;
  l.hidden = 4096, l.layers = 32, l.heads = 32, l.kv_heads = 32, l.ffn = 11008, l.vocab = 32000;
  l.max_seq = 8192;
  weft::EncoderSpec v;
  v.name = "vision";
  v.hidden = 1024, v.layers = 24, v.heads = 16, v.ffn = 4096, v.feature_layer = -2;
  v.image_size = 336, v.patch = 14;
  s.model.encoders = {v};
  return s;
}

struct Mix {
  std::string name;
  std::function<SampleShape(std::mt19937_64&)> sample;
};

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

SampleShape shape(int64_t images, int64_t text) {
  SampleShape s;
  s.items = {images};
  s.tokens = images * kImage + text;
  s.targets = text;  // the loss is on text only
  return s;
}

std::vector<Mix> mixes() {
  return {
      {"llava: 70% 1 image, 30% text",
       [](std::mt19937_64& r) {
         return shape(uniform(r, 0, 9) < 7 ? 1 : 0, uniform(r, 100, 2000));
       }},
      {"video: 50% 8 frames, 25% 1 image, 25% text",
       [](std::mt19937_64& r) {
         const int64_t k = uniform(r, 0, 3);
         return shape(k < 2 ? 8 : k == 2 ? 1 : 0, uniform(r, 50, 1500));
       }},
      {"interleaved: 0-8 images, 200-4000 text",
       [](std::mt19937_64& r) { return shape(uniform(r, 0, 8), uniform(r, 200, 4000)); }},
  };
}

struct Figures {
  double enc = 0, llm = 0, combined = 0, cv = 0, objective = 0, makespan = 0;
};

// Adds one batch's figures; objective and makespan relative to in_order's on the same batch.
void add(Figures& f, const BatchBalance& b, const BatchBalance& in_order) {
  std::vector<double> enc, llm, cost;
  for (size_t r = 0; r < b.microbatch_work.size(); ++r)
    for (size_t m = 0; m < b.microbatch_work[r].size(); ++m) {
      enc.push_back(b.microbatch_work[r][m].encoder_total());
      llm.push_back(b.microbatch_work[r][m].llm);
      cost.push_back(b.microbatch_cost[r][m]);
    }
  f.enc += weft::plan::spread(enc).max_over_mean / kBatches;
  f.llm += weft::plan::spread(llm).max_over_mean / kBatches;
  f.combined += weft::plan::spread(cost).max_over_mean / kBatches;
  f.cv += weft::plan::spread(cost).cv / kBatches;
  f.objective += b.max_microbatch_cost() / in_order.max_microbatch_cost() / kBatches;
  f.makespan += b.max_makespan() / in_order.max_makespan() / kBatches;
}

void table(const char* title, const weft::plan::WorkModel& model, bool concurrent) {
  std::printf("\n%s\n", title);
  std::printf("%-44s %2s %2s %-9s %6s %6s %6s %7s %8s %8s\n", "mix", "D", "M", "policy", "enc",
              "llm", "comb", "cv", "max/ino", "1f1b/ino");
  for (const Mix& mix : mixes()) {
    for (int64_t D : {4, 8})
      for (int64_t M : {4, 8}) {
        std::mt19937_64 rng(static_cast<uint64_t>(1000 * D + M));
        Figures ino, llm_only, bal, bal_ordered;
        double reorder_alone = 0;
        for (int t = 0; t < kBatches; ++t) {
          std::vector<SampleWork> samples;
          for (int64_t i = 0; i < D * M * kSamplesPerMicrobatch; ++i)
            samples.push_back(model.work(mix.sample(rng)));
          BalanceCost cost = model.cost;
          if (concurrent) {  // devices split in proportion to each module's total work
            double e = 0, l = 0;
            for (const SampleWork& s : samples) e += s.encoder_total(), l += s.llm;
            cost.concurrent = true, cost.encoder_weight = {l / e};
          }
          const auto run = [&](const BalanceCost& c, BalancePolicy policy, int64_t stages) {
            BalanceOptions o;
            o.replicas = D, o.microbatches = M, o.policy = policy, o.pipeline_stages = stages;
            // Priced with the true cost and evaluated on kStages whatever the balancer saw.
            return weft::plan::evaluate_assignment(
                samples, cost, weft::plan::balance_batch(samples, c, o).assignment, kStages);
          };
          const BatchBalance a = run(cost, BalancePolicy::kInOrder, kStages);
          add(ino, a, a);
          BalanceCost llm_cost = cost;
          llm_cost.encoder_weight = {0.0};
          add(llm_only, run(llm_cost, BalancePolicy::kBalanced, kStages), a);
          add(bal, run(cost, BalancePolicy::kBalanced, 1), a);  // split only, in-order run order
          add(bal_ordered, run(cost, BalancePolicy::kBalanced, kStages), a);
          double reordered = 0;  // reordering alone, on in_order's split
          for (const auto& costs : a.microbatch_cost) {
            std::vector<double> c;
            for (int64_t i : weft::plan::order_for_1f1b(costs, kStages))
              c.push_back(costs[static_cast<size_t>(i)]);
            reordered = std::max(reordered, weft::plan::one_f_one_b_makespan(c, kStages));
          }
          reorder_alone += reordered / a.max_makespan() / kBatches;
        }
        const auto row = [&](const char* name, const char* policy, const Figures& f) {
          std::printf("%-44s %2lld %2lld %-9s %6.3f %6.3f %6.3f %7.4f %8.4f %8.4f\n", name,
                      static_cast<long long>(D), static_cast<long long>(M), policy, f.enc, f.llm,
                      f.combined, f.cv, f.objective, f.makespan);
        };
        row(mix.name.c_str(), "in_order", ino);
        row("", "llm_only", llm_only);
        row("", "balanced", bal);
        row("", "+reorder", bal_ordered);
        std::printf(
            "%-50s cv in_order/balanced %.1fx; 1f1b/ino of reordering in_order alone %.4f\n", "",
            ino.cv / bal_ordered.cv, reorder_alone);
      }
  }
}

}  // namespace

int main() {
  const weft::Spec spec = llava_spec();
  const weft::plan::WorkModel model =
      weft::plan::make_work_model(spec, weft::plan::make_plan(spec));
  std::printf(
      "per-microbatch max/mean (enc, llm, comb) and combined CV; max/ino = largest microbatch\n"
      "combined cost / in_order's (the objective); 1f1b/ino = slowest replica's 1F1B makespan\n"
      "(P = %lld) / in_order's; means over %d batches, %lld samples per microbatch\n",
      static_cast<long long>(kStages), kBatches, static_cast<long long>(kSamplesPerMicrobatch));
  table("colocated: combined = encoder + LLM FLOPs", model, false);
  table("separate: combined = max(encoder, LLM) on devices proportional to their total work", model,
        true);
  return 0;
}
