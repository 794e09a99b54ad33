#include "weft/train/data_shape.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "weft/data/collate.h"
#include "weft/data/dataset.h"
#include "weft/plan/balance.h"
#include "weft/plan/plan.h"
#include "weft/train/inputs.h"

namespace weft::train {

MeasuredData measure_data_shape(Spec spec, int64_t min_samples) {
  spec = plan::one_process(std::move(spec));  // the loader's split of one replica
  const std::unique_ptr<data::Dataset> dataset = data::make_dataset(&spec);  // sets the vocab
  const plan::Plan plan = plan::make_plan(spec, 1);
  const plan::WorkModel work_model = plan::make_work_model(spec, plan);
  plan::BalanceOptions bo;
  bo.microbatches = spec.train.microbatches;
  bo.policy = plan::parse_balance_policy(plan.balance);
  data::CollateOptions co;
  co.packing = spec.data.packing;
  co.max_seq = spec.model.llm.max_seq;

  const size_t E = spec.model.encoders.size();
  const int64_t batch = spec.train.batch;
  const int64_t steps = std::clamp<int64_t>((min_samples + batch - 1) / batch, 1, 64);
  double positions = 0, tokens = 0, targets = 0, sum_sq = 0;
  std::vector<double> items(E, 0);
  int64_t samples = 0;
  // The most of any sample: a padded microbatch keeps its longest row's positions per sample.
  double longest = 0, most_targets = 0;
  std::vector<double> most_items(E, 0);
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<data::Sample> layout = dataset->train_layout(step, batch);
    std::vector<plan::SampleWork> work;
    for (const data::Sample& s : layout) {
      const plan::SampleShape shape = shape_of(s, E);
      work.push_back(work_model.work(shape));
      const double len = static_cast<double>(shape.tokens);
      tokens += len;
      targets += static_cast<double>(shape.targets);
      sum_sq += len * len;  // one document per sample (packed ones stay isolated)
      longest = std::max(longest, len);
      most_targets = std::max(most_targets, static_cast<double>(shape.targets));
      for (size_t e = 0; e < E; ++e) {
        items[e] += static_cast<double>(shape.items[e]);
        most_items[e] = std::max(most_items[e], static_cast<double>(shape.items[e]));
      }
    }
    samples += static_cast<int64_t>(layout.size());
    const plan::BatchBalance b = plan::balance_batch(work, work_model.cost, bo);
    for (const std::vector<int64_t>& part : b.assignment.front()) {
      if (part.empty()) continue;
      std::vector<int64_t> lengths;
      for (int64_t i : part) lengths.push_back(static_cast<int64_t>(layout[i].tokens.size()));
      const std::vector<std::vector<size_t>> rows = data::pack_rows(lengths, co);
      int64_t row_len = 0;  // the microbatch's longest row: every row is padded to it
      for (const std::vector<size_t>& row : rows) {
        int64_t len = 0;
        for (size_t k : row) len += lengths[k];
        row_len = std::max(row_len, len);
      }
      positions += static_cast<double>(rows.size()) * static_cast<double>(row_len);
    }
  }
  MeasuredData out;
  out.vocab = spec.model.llm.vocab;
  plan::DataShape& d = out.shape;
  const double n = static_cast<double>(samples);
  d.samples = samples;
  d.positions = positions / n;
  d.tokens = tokens / n;
  d.targets = targets / n;
  d.sum_sq_doc_len = sum_sq / n;
  for (double v : items) d.items.push_back(v / n);
  // Packed rows fill up to max_seq, whatever the samples.
  d.peak_positions = spec.data.packing ? static_cast<double>(spec.model.llm.max_seq) : longest;
  d.peak_targets = most_targets;
  d.peak_items = most_items;
  plan::check_data_shape(spec, d, spec.source);
  return out;
}

plan::Plan default_plan(const Spec& spec, int64_t world_size, const plan::Profile* profile,
                        bool full_rows) {
  plan::Plan p = plan::make_plan(spec, world_size, profile);
  if (profile || full_rows) return p;
  bool cut = false;  // by the partitioner, on costs
  for (const plan::ModulePlan& m : p.modules) {
    if (m.role == plan::ModuleRole::kProjector || m.layout.stages() <= 1) continue;
    const auto it = spec.parallel.modules.find(m.name);
    cut = cut || it == spec.parallel.modules.end() || it->second.stages.empty();
  }
  if (!cut) return p;
  const MeasuredData data = measure_data_shape(spec);
  Spec priced = spec;  // the output head at the tokenizer's vocabulary
  if (priced.model.llm.vocab == 0) priced.model.llm.vocab = data.vocab;
  return plan::make_plan(priced, world_size, nullptr, &data.shape);
}

}  // namespace weft::train
