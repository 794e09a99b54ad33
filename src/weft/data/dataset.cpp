#include "weft/data/dataset.h"

#include "weft/core/error.h"
#include "weft/data/llava.h"
#include "weft/data/shapes.h"
#include "weft/data/synthetic.h"
#include "weft/data/tokenizer.h"

namespace weft::data {

namespace {

// The built-in procedural dataset behind the Dataset interface.
class ShapesData final : public Dataset {
 public:
  ShapesData(const Spec& spec, Tokenizer tok) : tok_(std::move(tok)), data_(spec, tok_) {}
  std::vector<Sample> train_layout(int64_t step, int64_t batch) override {
    return data_.train_layout(step, batch);
  }
  std::vector<int64_t> load_media(int64_t, std::vector<Sample>& layout,
                                  const std::vector<MediaRef>& wanted) override {
    for (const MediaRef& r : wanted) {
      Sample& s = layout[r.sample];
      ModalityItem& item = s.items[r.item];
      item.input = data_.item_input(ShapesDataset::kTrainStream, static_cast<uint64_t>(s.record),
                                    item.encoder);
      ++media_loaded_;
    }
    return {};
  }
  std::vector<Sample> eval_set() override { return data_.eval_set(); }
  int64_t vocab_size() const override { return tok_.vocab_size(); }
  int64_t pad_id() const override { return tok_.pad_id(); }
  int64_t eos_id() const override { return tok_.eos_id(); }
  std::string decode(const std::vector<int64_t>& ids) const override { return tok_.decode(ids); }

 private:
  Tokenizer tok_;
  ShapesDataset data_;
};

}  // namespace

std::vector<MediaRef> all_media(const std::vector<Sample>& layout) {
  std::vector<MediaRef> out;
  for (size_t i = 0; i < layout.size(); ++i)
    for (size_t j = 0; j < layout[i].items.size(); ++j)
      out.push_back({static_cast<int64_t>(i), static_cast<int64_t>(j)});
  return out;
}

std::vector<Sample> Dataset::train_batch(int64_t step, int64_t batch) {
  for (int round = 0;; ++round) {
    WEFT_CHECK(round < 1000, "step ", step + 1, ": the dataset keeps finding bad media");
    std::vector<Sample> layout = train_layout(step, batch);
    const std::vector<int64_t> bad = load_media(step, layout, all_media(layout));
    if (bad.empty()) return layout;
    std::vector<Sample> marked;
    for (int64_t i : bad) marked.push_back(layout[i]);
    mark_bad(marked);  // the next layout replaces them (a dataset gives up after too many)
  }
}

std::unique_ptr<Dataset> make_dataset(Spec* spec) {
  if (spec->data.kind == "llava") return std::make_unique<LlavaDataset>(spec);
  if (spec->data.kind == "synthetic") {
    auto data = std::make_unique<SyntheticDataset>(*spec);
    spec->data.seq_len = data->seq_len();  // 0 resolved
    return data;
  }
  Tokenizer tok = Tokenizer::for_shapes(spec->model);
  LlmSpec& llm = spec->model.llm;
  WEFT_CHECK(llm.vocab == 0 || llm.vocab >= tok.vocab_size(), spec->source,
             ": model.llm.vocab = ", llm.vocab, " is smaller than the tokenizer's ",
             tok.vocab_size(), " tokens (use 0 to take the tokenizer's size)");
  // vocab = 0: the tokenizer's size padded to a multiple of 64, so every usual TP size splits it
  // and every layout builds the same model.
  if (llm.vocab == 0) llm.vocab = (tok.vocab_size() + 63) / 64 * 64;
  return std::make_unique<ShapesData>(*spec, std::move(tok));
}

}  // namespace weft::data
