#include "weft/io/safetensors.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "weft/core/error.h"
#include "weft/io/files.h"

namespace weft::io {
namespace {

namespace fs = std::filesystem;

// Per-test scratch directory (unique per process and test, so tests may run in parallel).
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("weft_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    weft::io::remove_tree(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { weft::io::remove_tree(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// Writes raw bytes to `path`.
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

// Reads all bytes of `path`.
std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The 8-byte little-endian encoding of `n`.
std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A safetensors file image: size prefix, `header` verbatim, then `data`.
std::string file_image(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Expects `fn` to throw weft::Error whose message contains every string in `needles`.
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected weft::Error";
  } catch (const weft::Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) {
      EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
    }
  }
}

// Bitwise equality of two CPU tensors' contents (plus dtype and shape).
void expect_bit_identical(const at::Tensor& a, const at::Tensor& b, const std::string& name) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << name;
  ASSERT_EQ(a.sizes(), b.sizes()) << name;
  EXPECT_TRUE(torch::equal(a, b)) << name;
  at::Tensor ac = a.contiguous(), bc = b.contiguous();
  ASSERT_EQ(ac.nbytes(), bc.nbytes()) << name;
  if (ac.nbytes() > 0) {
    EXPECT_EQ(std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()), 0) << name;
  }
}

TEST_F(SafetensorsTest, RoundTripsEveryDtypeBitIdentical) {
  torch::manual_seed(0);
  TensorMap in = {
      {"f32", torch::randn({3, 4})},
      {"f16", torch::randn({5}).to(torch::kHalf)},
      {"bf16", torch::randn({2, 3, 2}).to(torch::kBFloat16)},
      {"f64", torch::randn({4}, torch::kDouble)},
      {"i64", torch::randint(-(int64_t{1} << 40), int64_t{1} << 40, {6}, torch::kLong)},
      {"i32", torch::randint(-1000000, 1000000, {2, 2}, torch::kInt)},
      {"i16", torch::randint(-30000, 30000, {3}, torch::kShort)},
      {"i8", torch::randint(-128, 128, {7}, torch::kChar)},
      {"u8", torch::randint(0, 256, {9}, torch::kByte)},
      {"bool", torch::rand({10}) > 0.5},
      {"scalar", torch::scalar_tensor(3.25, torch::kFloat)},
      {"empty", torch::empty({0, 5})},
      {"empty_i64", torch::empty({2, 0}, torch::kLong)},
      {"transposed", torch::randn({3, 5}).t()},  // non-contiguous: saved contiguous
  };
  const std::string p = path("all.safetensors");
  save_safetensors(p, in);
  SafetensorsFile out = load_safetensors(p);
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out.tensors[i].first, in[i].first);
    expect_bit_identical(out.tensors[i].second, in[i].second, in[i].first);
    EXPECT_TRUE(out.tensors[i].second.is_contiguous()) << in[i].first;
  }
  EXPECT_EQ(out.tensors[10].second.dim(), 0);
  EXPECT_TRUE(out.metadata.empty());
}

TEST_F(SafetensorsTest, TensorsOutliveTheFile) {
  const std::string p = path("gone.safetensors");
  at::Tensor t = torch::arange(1000, torch::kFloat);
  save_safetensors(p, {{"t", t}});
  SafetensorsFile out = load_safetensors(p);
  fs::remove(p);
  EXPECT_TRUE(torch::equal(out.tensors.at(0).second, t));
}

TEST_F(SafetensorsTest, PreservesOrder) {
  TensorMap in;
  for (const char* name : {"zeta", "alpha", "mid", "beta", "a.b.c", "0"}) {
    in.emplace_back(name, torch::randn({2}));
  }
  in.emplace(in.begin() + 2, "empty_in_middle", torch::empty({0}));
  const std::string p = path("order.safetensors");
  save_safetensors(p, in);
  SafetensorsFile out = load_safetensors(p);
  ASSERT_EQ(out.tensors.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(out.tensors[i].first, in[i].first);
}

TEST_F(SafetensorsTest, OrderFollowsDataOffsetsNotHeaderOrder) {
  // A hand-written file whose header lists tensors out of data order.
  const std::string header = R"({"second":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},)"
                             R"("first":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const std::string p = path("offsets.safetensors");
  write_bytes(p, file_image(header, std::string("\x07\x09", 2)));
  SafetensorsFile out = load_safetensors(p);
  ASSERT_EQ(out.tensors.size(), 2u);
  EXPECT_EQ(out.tensors[0].first, "first");
  EXPECT_EQ(out.tensors[0].second.item<uint8_t>(), 7);
  EXPECT_EQ(out.tensors[1].first, "second");
  EXPECT_EQ(out.tensors[1].second.item<uint8_t>(), 9);
}

TEST_F(SafetensorsTest, MetadataRoundTrips) {
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "1234"}, {"empty", ""}, {"json", R"({"a": [1, "x"]})"}};
  const std::string p = path("meta.safetensors");
  save_safetensors(p, {{"w", torch::ones({2, 2})}}, meta);
  SafetensorsFile out = load_safetensors(p);
  EXPECT_EQ(out.metadata, meta);
  ASSERT_EQ(out.tensors.size(), 1u);

  // Metadata-only files are fine too.
  save_safetensors(p, {}, meta);
  out = load_safetensors(p);
  EXPECT_EQ(out.metadata, meta);
  EXPECT_TRUE(out.tensors.empty());
}

TEST_F(SafetensorsTest, HeaderLayoutMatchesTheFormat) {
  const std::string p = path("layout.safetensors");
  save_safetensors(p, {{"a", torch::ones({3}, torch::kInt)}, {"b", torch::zeros({2, 1})}},
                   {{"k", "v"}});
  const std::string bytes = read_bytes(p);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<uint8_t>(bytes[i])} << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 3 * 4 + 2 * 4);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["__metadata__"]["k"], "v");
  EXPECT_EQ(header["a"]["dtype"], "I32");
  EXPECT_EQ(header["a"]["shape"], nlohmann::json::array({3}));
  EXPECT_EQ(header["a"]["data_offsets"], nlohmann::json::array({0, 12}));
  EXPECT_EQ(header["b"]["dtype"], "F32");
  EXPECT_EQ(header["b"]["shape"], nlohmann::json::array({2, 1}));
  EXPECT_EQ(header["b"]["data_offsets"], nlohmann::json::array({12, 20}));
}

TEST_F(SafetensorsTest, LoadConvertsFloatingTensorsOnly) {
  torch::manual_seed(1);
  at::Tensor f32 = torch::randn({4, 3});
  at::Tensor f16 = torch::randn({5}).to(torch::kHalf);
  at::Tensor i64 = torch::arange(6, torch::kLong);
  at::Tensor b = torch::tensor({true, false});
  const std::string p = path("conv.safetensors");
  save_safetensors(p, {{"f32", f32}, {"f16", f16}, {"i64", i64}, {"b", b}});
  SafetensorsFile out = load_safetensors(p, torch::kBFloat16);
  ASSERT_EQ(out.tensors.size(), 4u);
  EXPECT_EQ(out.tensors[0].second.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(out.tensors[0].second, f32.to(torch::kBFloat16)));
  EXPECT_EQ(out.tensors[1].second.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(out.tensors[1].second, f16.to(torch::kBFloat16)));
  expect_bit_identical(out.tensors[2].second, i64, "i64");
  expect_bit_identical(out.tensors[3].second, b, "b");

  out = load_safetensors(p, torch::kFloat);
  expect_bit_identical(out.tensors[0].second, f32, "f32");
  EXPECT_TRUE(torch::equal(out.tensors[1].second, f16.to(torch::kFloat)));

  expect_error([&] { load_safetensors(p, torch::kLong); }, {p, "float_dtype"});
}

TEST_F(SafetensorsTest, AtomicWriteLeavesNoTmpAndReplacesOldFile) {
  const std::string p = path("ckpt.safetensors");
  save_safetensors(p, {{"x", torch::zeros({2})}});
  EXPECT_TRUE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));

  save_safetensors(p, {{"y", torch::ones({3})}});
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  SafetensorsFile out = load_safetensors(p);
  ASSERT_EQ(out.tensors.size(), 1u);
  EXPECT_EQ(out.tensors[0].first, "y");

  // A rejected save touches nothing: the old file survives and no .tmp appears.
  expect_error(
      [&] {
        save_safetensors(p, {{"c", torch::zeros({2}, torch::kComplexFloat)}});
      },
      {p, "'c'", "dtype"});
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  EXPECT_EQ(load_safetensors(p).tensors.at(0).first, "y");

  // An unwritable destination fails cleanly too.
  const std::string bad = path("no_such_dir/x.safetensors");
  expect_error([&] { save_safetensors(bad, {{"x", torch::zeros({1})}}); }, {bad});
  EXPECT_FALSE(fs::exists(bad + ".tmp"));
}

TEST_F(SafetensorsTest, SaveRejectsBadNamesAndTensors) {
  const std::string p = path("bad.safetensors");
  at::Tensor t = torch::zeros({2});
  expect_error(
      [&] {
        save_safetensors(p, {{"a", t}, {"b", t}, {"a", t}});
      },
      {p, "'a'", "duplicate"});
  expect_error([&] { save_safetensors(p, {{"", t}}); }, {p, "empty name"});
  expect_error([&] { save_safetensors(p, {{"__metadata__", t}}); }, {p, "__metadata__"});
  expect_error([&] { save_safetensors(p, {{"u", at::Tensor()}}); }, {p, "'u'", "undefined"});
  at::Tensor meta = torch::empty({2}, torch::TensorOptions().device(torch::kMeta));
  expect_error([&] { save_safetensors(p, {{"ok", t}, {"m", meta}}); }, {p, "'m'", "CPU"});
  expect_error(
      [&] {
        save_safetensors(p, {{"c", torch::zeros({2}, torch::kComplexDouble)}});
      },
      {p, "'c'", "unsupported dtype"});
  EXPECT_FALSE(fs::exists(p));
  EXPECT_FALSE(fs::exists(p + ".tmp"));
}

// --- corrupt files -----------------------------------------------------------------------------

TEST_F(SafetensorsTest, RejectsTinyFile) {
  const std::string p = path("tiny.safetensors");
  write_bytes(p, "");
  expect_error([&] { load_safetensors(p); }, {p, "too small"});
  write_bytes(p, std::string("\x10\x00\x00", 3));
  expect_error([&] { load_safetensors(p); }, {p, "too small"});
}

TEST_F(SafetensorsTest, RejectsMissingFile) {
  const std::string p = path("missing.safetensors");
  expect_error([&] { load_safetensors(p); }, {p, "cannot open"});
}

TEST_F(SafetensorsTest, RejectsHeaderSizeBeyondFile) {
  const std::string p = path("hdr.safetensors");
  write_bytes(p, le64(1000) + "{}");
  expect_error([&] { load_safetensors(p); }, {p, "header size 1000"});
  write_bytes(p, le64(uint64_t{1} << 40) + "{}");
  expect_error([&] { load_safetensors(p); }, {p, "limit"});
}

TEST_F(SafetensorsTest, RejectsBadJson) {
  const std::string p = path("json.safetensors");
  write_bytes(p, file_image(R"({"w": {"dtype": "F32",)", ""));
  expect_error([&] { load_safetensors(p); }, {p, "not valid JSON"});
  write_bytes(p, file_image("[1, 2]", ""));
  expect_error([&] { load_safetensors(p); }, {p, "object"});
}

TEST_F(SafetensorsTest, RejectsMissingOrMistypedFields) {
  const std::string p = path("fields.safetensors");
  const std::string data(8, '\0');
  const std::pair<const char*, const char*> cases[] = {
      {R"({"w":{"shape":[2],"data_offsets":[0,8]}})", "dtype"},
      {R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", "shape"},
      {R"({"w":{"dtype":"F32","shape":[2]}})", "data_offsets"},
      {R"({"w":[1,2]})", "object"},
      {R"({"w":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", "dtype"},
      {R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", "shape"},
      {R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", "shape"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", "data_offsets"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,"8"]}})", "data_offsets"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", "data_offsets"},
  };
  for (const auto& [header, what] : cases) {
    SCOPED_TRACE(header);
    write_bytes(p, file_image(header, data));
    expect_error([&] { load_safetensors(p); }, {p, "'w'", what});
  }
}

TEST_F(SafetensorsTest, RejectsUnknownDtype) {
  const std::string p = path("dtype.safetensors");
  write_bytes(p, file_image(R"({"w":{"dtype":"F8_E9","shape":[2],"data_offsets":[0,2]}})",
                            std::string(2, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'w'", "F8_E9"});
}

TEST_F(SafetensorsTest, RejectsNegativeDim) {
  const std::string p = path("neg.safetensors");
  write_bytes(p, file_image(R"({"w":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}})",
                            std::string(2, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'w'", "negative"});
}

TEST_F(SafetensorsTest, RejectsReversedOffsets) {
  const std::string p = path("rev.safetensors");
  write_bytes(p, file_image(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})",
                            std::string(4, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'w'", "begin > end"});
}

TEST_F(SafetensorsTest, RejectsOffsetsPastEnd) {
  const std::string p = path("past.safetensors");
  write_bytes(p, file_image(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
                            std::string(12, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'w'", "past the end"});
}

TEST_F(SafetensorsTest, RejectsTruncatedFile) {
  const std::string p = path("trunc.safetensors");
  save_safetensors(p, {{"a", torch::ones({4})}, {"b", torch::ones({8})}});
  const std::string bytes = read_bytes(p);
  write_bytes(p, bytes.substr(0, bytes.size() - 5));
  expect_error([&] { load_safetensors(p); }, {p, "'b'", "truncated"});
  // Cut inside the header itself.
  write_bytes(p, bytes.substr(0, 20));
  expect_error([&] { load_safetensors(p); }, {p, "truncated"});
}

TEST_F(SafetensorsTest, RejectsSizeMismatch) {
  const std::string p = path("size.safetensors");
  write_bytes(p, file_image(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})",
                            std::string(16, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'w'", "needs 16"});
}

TEST_F(SafetensorsTest, RejectsOverlappingRanges) {
  const std::string p = path("overlap.safetensors");
  write_bytes(p, file_image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                            std::string(12, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'b'", "'a'", "overlaps"});
  // Identical ranges overlap too.
  write_bytes(p, file_image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                            std::string(4, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "overlaps"});
}

TEST_F(SafetensorsTest, RejectsBadMetadata) {
  const std::string p = path("meta.safetensors");
  write_bytes(p, file_image(R"({"__metadata__":{"step":12}})", ""));
  expect_error([&] { load_safetensors(p); }, {p, "'step'", "string"});
  write_bytes(p, file_image(R"({"__metadata__":["x"]})", ""));
  expect_error([&] { load_safetensors(p); }, {p, "__metadata__"});
}

TEST_F(SafetensorsTest, RejectsDuplicateNamesInHeader) {
  const std::string p = path("dup.safetensors");
  write_bytes(p, file_image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                            R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                            std::string(2, '\0')));
  expect_error([&] { load_safetensors(p); }, {p, "'w'", "duplicate"});
}

TEST_F(SafetensorsTest, RejectsInvalidBoolBytes) {
  const std::string p = path("bool.safetensors");
  write_bytes(p, file_image(R"({"flags":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
                            std::string("\x01\x00\x02", 3)));
  expect_error([&] { load_safetensors(p); }, {p, "'flags'", "BOOL"});
}

}  // namespace
}  // namespace weft::io

namespace weft::io {
namespace {

// The seeds and findings of scripts/fuzz's safetensors target: each loads or is a weft::Error
// naming the file.
TEST(SafetensorsFuzzInputs, LoadOrClearError) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(WEFT_SOURCE_DIR) /
                                                           "tests/fuzz/safetensors")) {
    ++n;
    try {
      load_safetensors(e.path().string());
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(e.path().filename().string()), std::string::npos)
          << err.what();
    }
  }
  EXPECT_GE(n, 2);
  EXPECT_EQ(
      load_safetensors(std::string(WEFT_SOURCE_DIR) + "/tests/fuzz/safetensors/seed-two-tensors")
          .tensors.size(),
      2u);
}

}  // namespace
}  // namespace weft::io
