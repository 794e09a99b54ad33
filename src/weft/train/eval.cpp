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

EvalResult evaluate_captions(const model::MultimodalModel& model,
                             const std::vector<data::Sample>& samples, const data::Dataset& dataset,
                             const EvalOptions& o) {
  torch::NoGradGuard no_grad;
  model::ComputeDtypeGuard dtype(o.compute_dtype);
  const int64_t batch = o.batch;
  const bool loss = o.loss, captions = o.captions;
  EvalResult r;
  int64_t correct = 0;
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
      data::Sample p = samples[end];
      WEFT_CHECK(P > 0 && P <= static_cast<int64_t>(p.tokens.size()), "eval sample ", end,
                 ": prompt length ", P, " out of range");
      max_new = std::max<int64_t>(max_new, static_cast<int64_t>(p.tokens.size()) - P + 2);
      p.tokens.resize(P);
      p.is_target.assign(P, 0);
      // Items after the prompt (a later image of an interleaved sample) are not part of it.
      p.items.erase(std::remove_if(p.items.begin(), p.items.end(),
                                   [P](const data::ModalityItem& it) { return it.start >= P; }),
                    p.items.end());
      prompts.push_back(std::move(p));
      ++end;
    }
    if (loss) {  // teacher-forced: the loss of every target of the whole samples
      const model::Inputs in = inputs_of(model, whole, dataset);
      loss_sum += model.loss_sum(in).item<double>();
      r.targets += in.targets.numel();
    }
    std::vector<std::vector<int64_t>> gen;
    if (captions) gen = generate_greedy(model, prompts, dataset, max_new, o.kv_cache);
    for (size_t i = 0; i < gen.size(); ++i) {
      const std::string text = dataset.decode(gen[i]);
      const std::string& ref = samples[begin + i].caption;
      correct += text == ref ? 1 : 0;
      if (r.examples.size() < 4) r.examples.emplace_back(text, ref);
      r.captions.push_back(text);
    }
    begin = end;
  }
  r.samples = static_cast<int64_t>(samples.size());
  r.caption_accuracy = !captions   ? -1
                       : r.samples ? static_cast<double>(correct) / static_cast<double>(r.samples)
                                   : 0;
  r.loss = r.targets ? loss_sum / static_cast<double>(r.targets) : NAN;
  return r;
}

}  // namespace weft::train
