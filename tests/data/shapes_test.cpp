// Tests for the word-level tokenizer and the procedural shapes dataset.
#include "weft/data/shapes.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "weft/core/error.h"
#include "weft/core/spec.h"
#include "weft/data/tokenizer.h"

namespace weft::data {
namespace {

Spec vision_spec() {
  Spec s;
  EncoderSpec v;
  v.name = "vision";
  v.kind = EncoderKind::kVit;
  v.image_size = 64;
  v.patch = 16;
  s.model.encoders = {v};
  s.data.eval_samples = 16;
  return s;
}

Spec av_spec() {
  Spec s = vision_spec();
  EncoderSpec a;
  a.name = "audio";
  a.kind = EncoderKind::kWhisper;
  a.mels = 40;
  a.frames = 64;
  s.model.encoders.push_back(a);
  return s;
}

ShapesDataset make(const Spec& s) { return ShapesDataset(s, Tokenizer::for_shapes(s.model)); }

std::vector<std::string> split(const std::string& text) {
  std::istringstream is(text);
  std::vector<std::string> out;
  for (std::string w; is >> w;) out.push_back(w);
  return out;
}

// Caption fields: "a <colour> <shape> in the <position...> [with a <pitch> <length> tone]".
struct Parsed {
  std::string colour, shape, position, pitch, length;
};

Parsed parse(const std::string& caption) {
  auto w = split(caption);
  Parsed p;
  EXPECT_GE(w.size(), 6u) << caption;
  if (w.size() < 6) return p;
  EXPECT_EQ(w[0], "a");
  EXPECT_EQ(w[3], "in");
  EXPECT_EQ(w[4], "the");
  p.colour = w[1];
  p.shape = w[2];
  size_t i = 5;
  for (; i < w.size() && w[i] != "with"; ++i) p.position += (p.position.empty() ? "" : " ") + w[i];
  if (i < w.size()) {
    EXPECT_EQ(w.size(), i + 5) << caption;
    EXPECT_EQ(w[i + 1], "a");
    EXPECT_EQ(w[i + 4], "tone");
    if (w.size() == i + 5) {
      p.pitch = w[i + 2];
      p.length = w[i + 3];
    }
  }
  return p;
}

// 3x3 cell (row, col) of a position phrase.
std::pair<int, int> cell_of(const std::string& position) {
  static const std::map<std::string, std::pair<int, int>> cells = {
      {"top left", {0, 0}},    {"top", {0, 1}},    {"top right", {0, 2}},
      {"left", {1, 0}},        {"center", {1, 1}}, {"right", {1, 2}},
      {"bottom left", {2, 0}}, {"bottom", {2, 1}}, {"bottom right", {2, 2}}};
  auto it = cells.find(position);
  EXPECT_NE(it, cells.end()) << position;
  return it == cells.end() ? std::pair<int, int>{-1, -1} : it->second;
}

TEST(Tokenizer, IdLayout) {
  Tokenizer tok({"vision", "audio"}, {"a", "red", "circle"});
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.placeholder_id(0), 3);
  EXPECT_EQ(tok.placeholder_id(1), 4);
  EXPECT_EQ(tok.vocab_size(), 8);
  EXPECT_EQ(tok.token(3), "<vision>");
  EXPECT_EQ(tok.token(4), "<audio>");
  EXPECT_EQ(tok.encode("a red circle"), (std::vector<int64_t>{5, 6, 7}));
}

TEST(Tokenizer, RoundTrip) {
  const Tokenizer tok = Tokenizer::for_shapes(av_spec().model);
  const std::string text = "a red circle in the top left with a high short tone";
  const auto ids = tok.encode(text);
  EXPECT_EQ(ids.size(), 12u);
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_EQ(tok.decode(tok.encode("  a\tblue \n cross  ")), "a blue cross");
  EXPECT_TRUE(tok.encode("").empty());
  EXPECT_TRUE(tok.encode(" \t\n").empty());

  // Special and placeholder tokens are skipped; decoding stops at <eos>.
  std::vector<int64_t> seq = {tok.bos_id(), tok.placeholder_id(0), tok.placeholder_id(1)};
  seq.insert(seq.end(), ids.begin(), ids.end());
  seq.push_back(tok.pad_id());
  seq.push_back(tok.eos_id());
  seq.push_back(ids[0]);
  EXPECT_EQ(tok.decode(seq), text);
}

TEST(Tokenizer, Errors) {
  const Tokenizer tok = Tokenizer::for_shapes(vision_spec().model);
  try {
    tok.encode("a red hexagon in the top");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("hexagon"), std::string::npos) << msg;
    EXPECT_NE(msg.find("a red hexagon in the top"), std::string::npos) << msg;
  }
  EXPECT_THROW(tok.encode("<bos> a"), Error);     // special tokens are not text
  EXPECT_THROW(tok.encode("a <vision>"), Error);  // nor are placeholders
  EXPECT_THROW(tok.encode("a tone"), Error);      // audio words only with a whisper encoder
  EXPECT_THROW(tok.decode({tok.vocab_size()}), Error);
  EXPECT_THROW(tok.decode({-1}), Error);
  EXPECT_THROW(tok.placeholder_id(1), Error);
  EXPECT_THROW(tok.placeholder_id(-1), Error);
  EXPECT_THROW(Tokenizer({"v"}, {"a", "b", "a"}), Error);
  EXPECT_THROW(Tokenizer({"v", "v"}, {"a"}), Error);
  EXPECT_THROW(Tokenizer({"v"}, {"two words"}), Error);
  EXPECT_THROW(Tokenizer({"v"}, {""}), Error);
}

TEST(Tokenizer, ForShapesVocabulary) {
  const Tokenizer v = Tokenizer::for_shapes(vision_spec().model);
  const Tokenizer av = Tokenizer::for_shapes(av_spec().model);
  EXPECT_EQ(v.vocab_size(), 3 + 1 + static_cast<int64_t>(ShapesDataset::words(false).size()));
  EXPECT_EQ(av.vocab_size(), 3 + 2 + static_cast<int64_t>(ShapesDataset::words(true).size()));
  EXPECT_EQ(av.token(av.placeholder_id(1)), "<audio>");
  // The audio vocabulary extends the image one; shared words keep their order.
  const auto w = ShapesDataset::words(false);
  const auto wa = ShapesDataset::words(true);
  ASSERT_GT(wa.size(), w.size());
  EXPECT_TRUE(std::equal(w.begin(), w.end(), wa.begin()));
}

TEST(Shapes, Deterministic) {
  const Spec spec = av_spec();
  const ShapesDataset a = make(spec);
  const ShapesDataset b = make(spec);
  // Regenerated independently and out of order: bit-identical.
  const Sample later = b.sample(0, 99);
  for (uint64_t index : {17u, 3u, 99u}) {
    const Sample x = a.sample(0, index);
    const Sample y = b.sample(0, index);
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.is_target, y.is_target);
    EXPECT_EQ(x.caption, y.caption);
    ASSERT_EQ(x.items.size(), 2u);
    for (size_t i = 0; i < x.items.size(); ++i)
      EXPECT_TRUE(torch::equal(x.items[i].input, y.items[i].input)) << index << " item " << i;
  }
  EXPECT_TRUE(torch::equal(later.items[0].input, a.sample(0, 99).items[0].input));

  // Different index: different image and tone; different seed: different sample.
  EXPECT_FALSE(torch::equal(a.sample(0, 17).items[0].input, a.sample(0, 18).items[0].input));
  EXPECT_FALSE(torch::equal(a.sample(0, 17).items[1].input, a.sample(0, 18).items[1].input));
  Spec other = spec;
  other.data.seed = spec.data.seed + 1;
  EXPECT_FALSE(
      torch::equal(make(other).sample(0, 17).items[0].input, a.sample(0, 17).items[0].input));
}

TEST(Shapes, BatchesAndStreams) {
  const ShapesDataset ds = make(vision_spec());
  const auto batch = ds.train_batch(3, 4);
  ASSERT_EQ(batch.size(), 4u);
  for (size_t j = 0; j < batch.size(); ++j) {
    const Sample s = ds.sample(0, 12 + j);
    EXPECT_EQ(batch[j].tokens, s.tokens);
    EXPECT_TRUE(torch::equal(batch[j].items[0].input, s.items[0].input));
  }
  const auto eval = ds.eval_set();
  ASSERT_EQ(eval.size(), 16u);
  int same_caption = 0;
  for (size_t i = 0; i < eval.size(); ++i) {
    const Sample train = ds.sample(0, i);
    EXPECT_TRUE(torch::equal(eval[i].items[0].input, ds.sample(1, i).items[0].input));
    EXPECT_FALSE(torch::equal(eval[i].items[0].input, train.items[0].input)) << i;
    same_caption += eval[i].caption == train.caption;
  }
  EXPECT_LT(same_caption, 4);  // independent draws: about 16/216 expected
  EXPECT_THROW(ds.train_batch(-1, 4), Error);
  EXPECT_THROW(ds.train_batch(0, 0), Error);
}

// A data-parallel rank generates only its part; the parts, in order, are the global batch.
TEST(Shapes, BatchPartsConcatenateToTheBatch) {
  const ShapesDataset ds = make(vision_spec());
  const auto whole = ds.train_batch(5, 7);
  std::vector<Sample> joined;
  for (int64_t part = 0; part < 3; ++part) {
    const auto p = ds.train_batch(5, 7, part, 3);
    EXPECT_EQ(p.size(), part == 0 ? 3u : 2u);  // 7 = 3 + 2 + 2, as data::split
    joined.insert(joined.end(), p.begin(), p.end());
  }
  ASSERT_EQ(joined.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_EQ(joined[i].tokens, whole[i].tokens) << i;
  EXPECT_THROW(ds.train_batch(5, 7, 3, 3), Error);
}

TEST(Shapes, SequenceLayout) {
  const Spec spec = av_spec();
  const Tokenizer tok = Tokenizer::for_shapes(spec.model);
  const ShapesDataset ds(spec, tok);
  const int64_t vis = spec.model.encoders[0].tokens_per_item();
  const int64_t aud = spec.model.encoders[1].tokens_per_item();
  ASSERT_EQ(vis, 16);
  ASSERT_EQ(aud, 32);
  EXPECT_EQ(ds.prompt_length(), 1 + vis + aud);
  std::set<size_t> lengths;
  for (uint64_t i = 0; i < 64; ++i) {
    const Sample s = ds.sample(0, i);
    const auto n = static_cast<int64_t>(s.tokens.size());
    lengths.insert(s.tokens.size());
    ASSERT_EQ(s.is_target.size(), s.tokens.size());
    EXPECT_LE(n, ds.sequence_length());
    EXPECT_EQ(s.tokens.front(), tok.bos_id());
    EXPECT_EQ(s.tokens.back(), tok.eos_id());
    ASSERT_EQ(s.items.size(), 2u);
    EXPECT_EQ(s.items[0].encoder, 0);
    EXPECT_EQ(s.items[0].start, 1);
    EXPECT_EQ(s.items[0].length, vis);
    EXPECT_EQ(s.items[1].encoder, 1);
    EXPECT_EQ(s.items[1].start, 1 + vis);
    EXPECT_EQ(s.items[1].length, aud);
    for (const auto& item : s.items)
      for (int64_t t = item.start; t < item.start + item.length; ++t)
        EXPECT_EQ(s.tokens[t], tok.placeholder_id(item.encoder));
    EXPECT_EQ(s.prompt_length, 1 + vis + aud);
    int64_t placeholders = 0;
    for (int64_t t : s.tokens) placeholders += tok.is_special(t) && t > tok.eos_id();
    EXPECT_EQ(placeholders, vis + aud);
    for (int64_t t = 0; t < n; ++t) EXPECT_EQ(s.is_target[t], t >= s.prompt_length ? 1 : 0);

    std::vector<int64_t> targets;
    for (int64_t t = 0; t < n; ++t)
      if (s.is_target[t]) targets.push_back(s.tokens[t]);
    EXPECT_EQ(tok.decode(targets), s.caption);
    EXPECT_EQ(tok.encode(s.caption).size() + 1, targets.size());
    const Parsed p = parse(s.caption);
    EXPECT_FALSE(p.pitch.empty()) << s.caption;

    EXPECT_EQ(s.items[0].input.sizes(), (std::vector<int64_t>{3, 64, 64}));
    EXPECT_EQ(s.items[1].input.sizes(), (std::vector<int64_t>{40, 64}));
    EXPECT_EQ(s.items[0].input.scalar_type(), torch::kFloat);
    EXPECT_EQ(s.items[1].input.scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::isfinite(s.items[1].input).all().item<bool>());
  }
  EXPECT_EQ(static_cast<int64_t>(*lengths.rbegin()), ds.sequence_length());
  EXPECT_GT(lengths.size(), 1u);  // one- and two-word positions
}

TEST(Shapes, VisionOnlyHasNoAudio) {
  const ShapesDataset ds = make(vision_spec());
  EXPECT_FALSE(ds.with_audio());
  for (uint64_t i = 0; i < 16; ++i) {
    const Sample s = ds.sample(0, i);
    EXPECT_EQ(s.items.size(), 1u);
    EXPECT_EQ(s.caption.find("tone"), std::string::npos);
    EXPECT_TRUE(parse(s.caption).pitch.empty());
  }
}

// The caption's colour is the shape's colour and its position is where the shape is.
TEST(Shapes, ImageMatchesCaption) {
  const ShapesDataset ds = make(vision_spec());
  // Channels (R, G, B) that are bright for each colour name; the others are dark.
  const std::map<std::string, std::vector<int>> bright = {{"red", {0}},       {"green", {1}},
                                                          {"blue", {2}},      {"yellow", {0, 1}},
                                                          {"purple", {0, 2}}, {"cyan", {1, 2}}};
  for (uint64_t i = 0; i < 200; ++i) {
    const Sample s = ds.sample(0, i);
    const Parsed p = parse(s.caption);
    const auto img = (s.items[0].input * 0.5 + 0.5).contiguous();  // back to [0, 1]
    EXPECT_LE(img.min().item<float>(), 1.0f);
    const int64_t h = img.size(1), w = img.size(2);
    // Shape pixels: any channel well above the dark gray background.
    const auto mask = std::get<0>(img.max(0)) > 0.5;
    const int64_t count = mask.sum().item<int64_t>();
    ASSERT_GT(count, 40) << s.caption;
    const auto inside = img.masked_select(mask.unsqueeze(0)).view({3, -1}).mean(1);
    const auto outside = img.masked_select(mask.logical_not().unsqueeze(0)).view({3, -1}).mean(1);
    const auto in = inside.accessor<float, 1>();
    const auto out = outside.accessor<float, 1>();
    const auto& hi = bright.at(p.colour);
    float min_hi = 1.0f, max_lo = 0.0f;
    for (int c = 0; c < 3; ++c) {
      const bool is_hi = std::find(hi.begin(), hi.end(), c) != hi.end();
      if (is_hi)
        min_hi = std::min(min_hi, in[c]);
      else
        max_lo = std::max(max_lo, in[c]);
      EXPECT_NEAR(out[c], 0.2f, 0.05f) << s.caption;  // gray background
    }
    EXPECT_GT(min_hi, max_lo + 0.2f)
        << s.caption << " mean rgb " << in[0] << " " << in[1] << " " << in[2];

    // Centroid and bounding box of the shape lie in the named 3x3 cell.
    const auto idx = mask.nonzero().to(torch::kFloat);  // [count, 2] (y, x)
    const float cy = (idx.select(1, 0).mean().item<float>() + 0.5f) / h;
    const float cx = (idx.select(1, 1).mean().item<float>() + 0.5f) / w;
    const auto [row, col] = cell_of(p.position);
    EXPECT_EQ(static_cast<int>(cy * 3), row) << s.caption << " centroid y " << cy;
    EXPECT_EQ(static_cast<int>(cx * 3), col) << s.caption << " centroid x " << cx;
    const float y0 = idx.select(1, 0).min().item<float>(),
                y1 = idx.select(1, 0).max().item<float>();
    const float x0 = idx.select(1, 1).min().item<float>(),
                x1 = idx.select(1, 1).max().item<float>();
    EXPECT_GE(y0, row * h / 3.0f - 1) << s.caption;
    EXPECT_LE(y1, (row + 1) * h / 3.0f) << s.caption;
    EXPECT_GE(x0, col * w / 3.0f - 1) << s.caption;
    EXPECT_LE(x1, (col + 1) * w / 3.0f) << s.caption;
  }
}

TEST(Shapes, ToneMatchesCaption) {
  const ShapesDataset ds = make(av_spec());
  std::map<std::string, std::pair<int64_t, int64_t>> band_range;  // pitch -> [min, max] band
  for (uint64_t i = 0; i < 120; ++i) {
    const Sample s = ds.sample(0, i);
    const Parsed p = parse(s.caption);
    const auto mel = s.items[1].input;  // [mels, frames]
    const int64_t band = mel.mean(1).argmax().item<int64_t>();
    auto [it, fresh] = band_range.emplace(p.pitch, std::make_pair(band, band));
    if (!fresh) {
      it->second.first = std::min(it->second.first, band);
      it->second.second = std::max(it->second.second, band);
    }
    // Frames where the tone sounds: the loudest band is near the clip's maximum.
    const auto peak = std::get<0>(mel.max(0));  // [frames]
    const float top = peak.max().item<float>();
    const float floor = peak.min().item<float>();
    const int64_t active = (peak > (top + floor) / 2).sum().item<int64_t>();
    if (p.length == "short") {
      EXPECT_LT(active, 64 * 0.6) << s.caption;
    } else {
      EXPECT_EQ(p.length, "long");
      EXPECT_GT(active, 64 * 0.75) << s.caption;
    }
  }
  ASSERT_EQ(band_range.size(), 3u);
  EXPECT_LT(band_range["low"].second, band_range["mid"].first);
  EXPECT_LT(band_range["mid"].second, band_range["high"].first);
}

TEST(Shapes, AllCombinationsAppear) {
  const ShapesDataset ds = make(vision_spec());
  std::set<std::string> seen;
  for (uint64_t i = 0; i < 3000; ++i) {
    const Parsed p = parse(ds.sample(0, i).caption);
    seen.insert(p.colour + "|" + p.shape + "|" + p.position);
  }
  EXPECT_EQ(seen.size(), 216u);
}

TEST(Shapes, Errors) {
  Spec spec = vision_spec();
  spec.model.encoders[0].kind = EncoderKind::kWhisper;
  EXPECT_THROW(make(spec), Error);  // no vit encoder

  spec = av_spec();
  const int64_t need = make(spec).sequence_length();
  spec.model.llm.max_seq = need - 1;
  try {
    make(spec);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.llm.max_seq"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(need)), std::string::npos) << msg;
  }
  spec.model.llm.max_seq = need;
  EXPECT_NO_THROW(make(spec));

  // The tokenizer must match the model's encoders and know the audio words.
  EXPECT_THROW(ShapesDataset(av_spec(), Tokenizer::for_shapes(vision_spec().model)), Error);
  EXPECT_THROW(
      ShapesDataset(av_spec(), Tokenizer({"vision", "audio"}, ShapesDataset::words(false))), Error);

  spec = vision_spec();
  spec.model.llm.vocab = Tokenizer::for_shapes(spec.model).vocab_size() - 1;
  EXPECT_THROW(make(spec), Error);
}

}  // namespace
}  // namespace weft::data
