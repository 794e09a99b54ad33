#include "weft/train/eval.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "weft/core/error.h"
#include "weft/data/collate.h"
#include "weft/model/mask.h"
#include "weft/train/inputs.h"

namespace weft::train {

namespace {

// Samples collated into the model's inputs, on its device.
model::Inputs inputs_of(const model::MultimodalModel& model, const std::vector<data::Sample>& s,
                        const data::Dataset& tok) {
  data::CollateOptions opts;
  opts.num_encoders = static_cast<int>(model.spec().encoders.size());
  opts.pad_id = tok.pad_id();
  return model::to_device(to_inputs(data::collate(s, opts)), model.param_set().device());
}

}  // namespace

std::vector<std::vector<int64_t>> generate_greedy(const model::MultimodalModel& model,
                                                  const std::vector<data::Sample>& prompts,
                                                  const data::Dataset& tok, int64_t max_new,
                                                  bool kv_cache) {
  model::Inputs in = inputs_of(model, prompts, tok);
  const int64_t B = in.tokens.size(0), P = in.tokens.size(1);
  at::Tensor x = model.embed(in);
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(B));
  std::vector<bool> done(static_cast<size_t>(B), false);
  const int64_t max_len = std::min(P + max_new, model.spec().llm.max_seq);
  model::KvCache cache;
  cache.capacity = max_len;
  for (int64_t len = P; len < max_len; ++len) {
    at::Tensor h;                // final-normed hidden state of position len - 1
    if (kv_cache && len == P) {  // the prompt, once
      h = model.llm().decode(x, in.positions, model::visible_mask(in.doc, in.item), cache);
      h = h.select(1, len - 1);
    } else if (kv_cache) {  // the token generated last, at position len - 1
      const at::Tensor pos = torch::full({B, 1}, len - 1, in.tokens.options());
      h = model.llm().decode(x, pos, at::Tensor(), cache).select(1, 0);
    } else {  // the whole sequence again
      in.positions = torch::arange(len, in.tokens.options()).unsqueeze(0).expand({B, len});
      in.doc = torch::zeros({B, len}, in.item.options());
      if (in.item.size(1) < len)
        in.item = torch::cat(
            {in.item, torch::full({B, len - in.item.size(1)}, -1, in.item.options())}, 1);
      h = model.hidden(x, in).select(1, len - 1);
    }
    // Only the tokenizer's ids: the vocabulary may be padded past them.
    at::Tensor next = model.llm().logits(h).narrow(-1, 0, tok.vocab_size()).argmax(-1);  // [B]
    bool all_done = true;
    const at::Tensor host = next.to(at::kCPU);
    auto acc = host.accessor<int64_t, 1>();
    for (int64_t b = 0; b < B; ++b) {
      if (!done[b]) {
        out[b].push_back(acc[b]);
        if (acc[b] == tok.eos_id()) done[b] = true;
      }
      all_done = all_done && done[b];
    }
    if (all_done) break;
    const at::Tensor e = model.llm().embed(next.unsqueeze(1));
    x = kv_cache ? e : torch::cat({x, e}, 1);
  }
  return out;
}

data::Sample prompt_of(const data::Sample& sample) {
  const int64_t P = sample.prompt_length;
  WEFT_CHECK(P > 0 && P <= static_cast<int64_t>(sample.tokens.size()), "eval sample (record ",
             sample.record, "): prompt length ", P, " out of range for ", sample.tokens.size(),
             " tokens");
  data::Sample p = sample;
  p.tokens.resize(P);
  p.is_target.assign(P, 0);
  p.items.erase(std::remove_if(p.items.begin(), p.items.end(),
                               [P](const data::ModalityItem& it) { return it.start >= P; }),
                p.items.end());
  return p;
}

int64_t generation_budget(const data::Sample& sample) {
  return static_cast<int64_t>(sample.tokens.size()) - sample.prompt_length + 2;
}

void add_captions(EvalResult& r, const std::vector<std::vector<int64_t>>& generated,
                  const std::vector<data::Sample>& samples, const data::Dataset& dataset) {
  for (const std::vector<int64_t>& ids : generated) {
    const std::string text = dataset.decode(ids);
    const std::string& ref = samples.at(r.captions.size()).caption;
    if (r.examples.size() < 4) r.examples.emplace_back(text, ref);
    r.captions.push_back(text);
  }
}

double caption_accuracy(const std::vector<std::string>& captions,
                        const std::vector<data::Sample>& samples) {
  if (captions.empty()) return 0;
  int64_t correct = 0;
  for (size_t i = 0; i < captions.size(); ++i) correct += captions[i] == samples.at(i).caption;
  return static_cast<double>(correct) / static_cast<double>(captions.size());
}

EvalResult evaluate_captions(const model::MultimodalModel& model,
                             const std::vector<data::Sample>& samples, const data::Dataset& dataset,
                             const EvalOptions& o) {
  torch::NoGradGuard no_grad;
  model::ComputeDtypeGuard dtype(o.compute_dtype);
  const int64_t batch = o.batch;
  const bool loss = o.loss, captions = o.captions;
  EvalResult r;
  double loss_sum = 0;
  for (size_t begin = 0; begin < samples.size();) {
    // A group: consecutive samples with the same prompt length, at most `batch`.
    const int64_t P = samples[begin].prompt_length;
    std::vector<data::Sample> prompts, whole;
    size_t end = begin;
    int64_t max_new = 0;
    while (end < samples.size() && samples[end].prompt_length == P &&
           static_cast<int64_t>(prompts.size()) < batch) {
      whole.push_back(samples[end]);
      prompts.push_back(prompt_of(samples[end]));
      max_new = std::max(max_new, generation_budget(samples[end]));
      ++end;
    }
    if (loss) {  // teacher-forced: the loss of every target of the whole samples
      const model::Inputs in = inputs_of(model, whole, dataset);
      loss_sum += model.loss_sum(in).item<double>();
      r.targets += in.targets.numel();
    }
    if (captions) {
      std::vector<std::vector<int64_t>> gen =
          generate_greedy(model, prompts, dataset, max_new, o.kv_cache);
      // Each sample its own budget (greedy rows do not depend on each other): what generating
      // it alone, or in another group, gives.
      for (size_t i = 0; i < gen.size(); ++i) {
        const auto budget = static_cast<size_t>(generation_budget(whole[i]));
        if (gen[i].size() > budget) gen[i].resize(budget);
      }
      add_captions(r, gen, samples, dataset);
    }
    begin = end;
  }
  r.samples = static_cast<int64_t>(samples.size());
  r.caption_accuracy = captions ? caption_accuracy(r.captions, samples) : -1;
  r.loss = r.targets ? loss_sum / static_cast<double>(r.targets) : NAN;
  return r;
}

}  // namespace weft::train
