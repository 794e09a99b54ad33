// Image decoding and preprocessing (data/image_decode.h, data/image.h) against PIL and the HF
// processors: references made by tests/data/fixtures/media/make_fixtures.py.
#include "weft/data/image.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/errors.h"

namespace weft::data {
namespace {

namespace fs = std::filesystem;
using weft::testing::error_of;

const std::string kMediaDir = std::string(WEFT_SOURCE_DIR) + "/tests/data/fixtures/media/";

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f) << path;
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

DecodedImage make_image(int width, int height, uint8_t value = 0) {
  DecodedImage img;
  img.width = width;
  img.height = height;
  img.pixels.assign(static_cast<size_t>(width) * height * 3, value);
  return img;
}

struct Diff {
  int max = 0;
  double mean = 0.0;
};

// |got - ref| over width * height * 3 bytes; got must have that size.
Diff diff_u8(const DecodedImage& got, const uint8_t* ref, int width, int height) {
  EXPECT_EQ(got.width, width);
  EXPECT_EQ(got.height, height);
  Diff d;
  const size_t n = static_cast<size_t>(width) * height * 3;
  if (got.pixels.size() != n) {
    ADD_FAILURE() << "size " << got.pixels.size() << " != " << n;
    d.max = 256;
    return d;
  }
  for (size_t i = 0; i < n; ++i) {
    const int e = std::abs(static_cast<int>(got.pixels[i]) - static_cast<int>(ref[i]));
    d.max = std::max(d.max, e);
    d.mean += e;
  }
  d.mean /= static_cast<double>(n);
  return d;
}

ImageProcessor clip(int64_t size, int64_t crop, bool pad = false) {
  ImageProcessor p;
  p.size = size;
  p.crop = crop;
  p.pad_to_square = pad;
  return p;
}

// --- every fixture against PIL ---------------------------------------------------------------

class ImageFixture : public ::testing::TestWithParam<std::string> {};

// ref/<name>.u8 = decoded | clip 32/28 | siglip 24 | clip 80/40 | pad + clip 32/28.
TEST_P(ImageFixture, MatchesPilAndHfProcessors) {
  const std::string name = GetParam();
  const DecodedImage img = load_image(kMediaDir + name);
  const std::string ref = read_bytes(kMediaDir + "ref/" + name + ".u8");
  const auto* r = reinterpret_cast<const uint8_t*>(ref.data());
  const size_t decoded = static_cast<size_t>(img.width) * img.height * 3;
  ASSERT_EQ(ref.size(), decoded + 3 * (28 * 28 + 24 * 24 + 40 * 40 + 28 * 28)) << name;
  ASSERT_EQ(img.channels, 3);

  const Diff dec = diff_u8(img, r, img.width, img.height);
  EXPECT_EQ(dec.max, 0) << name << ": decoded pixels differ from PIL's convert(\"RGB\")";
  r += decoded;

  struct Case {
    const char* what;
    ImageProcessor p;
  };
  const Case cases[] = {{"clip 32/28", clip(32, 28)},
                        {"siglip 24", ImageProcessor::siglip(24)},
                        {"clip 80/40 (upsampling)", clip(80, 40)},
                        {"pad + clip 32/28", clip(32, 28, true)}};
  for (const Case& c : cases) {
    const int side = static_cast<int>(c.p.output_size());
    const Diff d = diff_u8(resize_and_crop(img, c.p), r, side, side);
    r += static_cast<size_t>(side) * side * 3;
    std::printf("[ %s ] %-24s max |diff| %d, mean %.5f (uint8, vs PIL)\n", name.c_str(), c.what,
                d.max, d.mean);
    EXPECT_LE(d.max, 1) << name << " " << c.what;
    EXPECT_LT(d.mean, 0.01) << name << " " << c.what;
  }
}

INSTANTIATE_TEST_SUITE_P(Image, ImageFixture,
                         ::testing::Values("rgb.png", "rgba.png", "gray.png", "gray_alpha.png",
                                           "palette.png", "bilevel.png", "rgb16.png", "gray16.png",
                                           "interlaced.png", "baseline.jpg", "progressive.jpg",
                                           "gray.jpg", "cmyk.jpg"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string s = info.param;
                           for (char& ch : s)
                             if (ch == '.') ch = '_';
                           return s;
                         });

// --- preprocessing ---------------------------------------------------------------------------

TEST(ImagePreprocess, NormalisesLikeHf) {
  const DecodedImage img = load_image(kMediaDir + "rgb.png");
  const ImageProcessor p = clip(32, 28);
  const at::Tensor x = preprocess_image(img, p);
  ASSERT_EQ(x.sizes(), (at::IntArrayRef{3, 28, 28}));
  ASSERT_EQ(x.scalar_type(), at::kFloat);
  const DecodedImage u8 = resize_and_crop(img, p);
  // HF: rescale (float64, cast to float32), then (x - mean) / std in float32; [C, H, W].
  const float* v = x.data_ptr<float>();
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < 28 * 28; ++i) {
      const auto s = static_cast<float>(u8.pixels[i * 3 + c] * (1.0 / 255.0));
      const float want = (s - static_cast<float>(p.mean[c])) / static_cast<float>(p.std[c]);
      ASSERT_EQ(v[c * 28 * 28 + i], want) << "channel " << c << " pixel " << i;
    }
  // CLIP's black is (0 - mean) / std, white (1 - mean) / std.
  const at::Tensor black = preprocess_image(make_image(5, 9, 0), p);
  EXPECT_NEAR(black[0][0][0].item<float>(), -0.48145466 / 0.26862954, 1e-6);
  const at::Tensor white = preprocess_image(make_image(9, 5, 255), ImageProcessor::siglip(16));
  EXPECT_EQ(white.sizes(), (at::IntArrayRef{3, 16, 16}));
  EXPECT_FLOAT_EQ(white.min().item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(white.max().item<float>(), 1.0f);
}

TEST(ImagePreprocess, DefaultsAreClip224) {
  const at::Tensor x = preprocess_image(make_image(300, 200, 100), ImageProcessor{});
  EXPECT_EQ(x.sizes(), (at::IntArrayRef{3, 224, 224}));
  const ImageProcessor s = ImageProcessor::siglip(384);
  EXPECT_EQ(s.output_size(), 384);
  EXPECT_EQ(s.mean[1], 0.5);
  EXPECT_EQ(s.std[2], 0.5);
}

TEST(ImagePreprocess, RejectsBadProcessors) {
  const DecodedImage img = make_image(8, 8);
  EXPECT_NE(error_of([&] { resize_and_crop(img, clip(0, 4)); }).find("size = 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { resize_and_crop(img, clip(8, 100000)); }).find("crop = 100000"),
            std::string::npos);
  ImageProcessor p = clip(8, 8);
  p.std[1] = 0.0;
  EXPECT_NE(error_of([&] { preprocess_image(img, p); }).find("std[1]"), std::string::npos);
  DecodedImage bad = make_image(4, 4);
  bad.pixels.pop_back();
  EXPECT_NE(error_of([&] { preprocess_image(bad, clip(8, 8)); }).find("width * height * 3"),
            std::string::npos);
  // The long side of a 1x5000 strip at shortest edge 224 would be 1.12 M pixels.
  EXPECT_NE(
      error_of([&] { resize_and_crop(make_image(1, 5000), clip(224, 224)); }).find("pixels long"),
      std::string::npos);
}

// --- the uint8 steps -------------------------------------------------------------------------

TEST(ImageResize, ConstantStaysConstant) {
  for (const auto& [w, h] : {std::pair{17, 9}, std::pair{3, 40}, std::pair{64, 64}}) {
    const DecodedImage out = resize_bicubic(make_image(23, 31, 200), w, h);
    ASSERT_EQ(out.pixels.size(), static_cast<size_t>(w) * h * 3);
    for (uint8_t v : out.pixels) ASSERT_EQ(v, 200) << w << "x" << h;
  }
}

TEST(ImageResize, ShrinkingAntialiases) {
  // A one-pixel checkerboard shrunk 4x: PIL's support scales with the factor, so every output
  // pixel averages ~16 inputs to ~127.5; a plain 4-tap bicubic would alias to 0 / 255 patterns.
  DecodedImage img = make_image(64, 64);
  for (int y = 0; y < 64; ++y)
    for (int x = 0; x < 64; ++x)
      for (int c = 0; c < 3; ++c) img.pixels[(y * 64 + x) * 3 + c] = (x + y) % 2 ? 255 : 0;
  const DecodedImage out = resize_bicubic(img, 16, 16);
  for (int y = 2; y < 14; ++y)
    for (int x = 2; x < 14; ++x) EXPECT_NEAR(out.pixels[(y * 16 + x) * 3], 127.5, 1.0);
}

TEST(ImageResize, BicubicOvershootIsClipped) {
  // A hard 0 -> 255 edge upsampled: the a = -0.5 kernel rings below 0 and above 255 and PIL
  // clips; no wrap-around (a dark pixel next to the bright side) may appear.
  DecodedImage img = make_image(8, 1);
  for (int x = 4; x < 8; ++x)
    for (int c = 0; c < 3; ++c) img.pixels[x * 3 + c] = 255;
  const DecodedImage out = resize_bicubic(img, 64, 1);
  for (int x = 0; x < 64; ++x) {
    const int v = out.pixels[x * 3];
    if (x < 28) {
      EXPECT_LE(v, 2) << x;
    }
    if (x >= 36) {
      EXPECT_GE(v, 253) << x;
    }
  }
}

TEST(ImageCrop, CentresAndPadsWithZerosLikeHf) {
  DecodedImage img = make_image(5, 3);
  for (int i = 0; i < 15; ++i) img.pixels[i * 3] = static_cast<uint8_t>(i + 1);
  // Shrink: top = (3 - 1) // 2 = 1, left = (5 - 2) // 2 = 1.
  const DecodedImage small = center_crop(img, 2, 1);
  EXPECT_EQ(small.pixels[0], 7);
  EXPECT_EQ(small.pixels[3], 8);
  // Grow to 8 x 6: top = (3 - 6) // 2 = -2, left = (5 - 8) // 2 = -2, so the image sits at
  // rows 2..4, columns 2..6, zeros around.
  const DecodedImage big = center_crop(img, 8, 6);
  ASSERT_EQ(big.width, 8);
  ASSERT_EQ(big.height, 6);
  for (int y = 0; y < 6; ++y)
    for (int x = 0; x < 8; ++x) {
      const bool inside = y >= 2 && y < 5 && x >= 2 && x < 7;
      EXPECT_EQ(big.pixels[(y * 8 + x) * 3], inside ? (y - 2) * 5 + (x - 2) + 1 : 0) << x << y;
    }
}

TEST(ImageExpandToSquare, PastesAtTheCentreOnTheBackground) {
  const DecodedImage img = make_image(4, 1, 9);
  const DecodedImage sq = expand_to_square(img, {122, 116, 104});
  ASSERT_EQ(sq.width, 4);
  ASSERT_EQ(sq.height, 4);
  for (int y = 0; y < 4; ++y) {  // offset (4 - 1) // 2 = 1
    EXPECT_EQ(sq.pixels[(y * 4 + 2) * 3 + 0], y == 1 ? 9 : 122) << y;
    EXPECT_EQ(sq.pixels[(y * 4 + 2) * 3 + 2], y == 1 ? 9 : 104) << y;
  }
  const DecodedImage tall = expand_to_square(make_image(1, 3, 9), {1, 2, 3});
  EXPECT_EQ(tall.width, 3);
  EXPECT_EQ(tall.pixels[(0 * 3 + 1) * 3], 9);  // column (3 - 1) // 2 = 1
  EXPECT_EQ(tall.pixels[(0 * 3 + 0) * 3], 1);
}

// --- errors ----------------------------------------------------------------------------------

uint32_t crc32(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char ch : s) {
    c ^= ch;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return ~c;
}

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

// A PNG signature, an IHDR declaring width x height 8-bit RGB and an empty IDAT.
std::string png_header(uint32_t width, uint32_t height) {
  const std::string ihdr = "IHDR" + be32(width) + be32(height) + std::string("\x08\x02\0\0\0", 5);
  return std::string("\x89PNG\r\n\x1a\n", 8) + be32(13) + ihdr + be32(crc32(ihdr)) + be32(0) +
         "IDAT" + be32(crc32("IDAT"));
}

TEST(ImageDecode, ErrorsNameTheFile) {
  const std::string gif = "GIF89a\x01\x00\x01\x00";
  const std::string e = error_of([&] { decode_image(gif, "cat.gif"); });
  EXPECT_NE(e.find("cat.gif"), std::string::npos) << e;
  EXPECT_NE(e.find("PNG and JPEG"), std::string::npos) << e;

  const std::string png = read_bytes(kMediaDir + "rgb.png");
  const std::string t = error_of([&] { decode_image(png.substr(0, png.size() / 2), "half.png"); });
  EXPECT_NE(t.find("half.png"), std::string::npos) << t;
  EXPECT_NE(t.find("truncated"), std::string::npos) << t;

  const std::string jpg = read_bytes(kMediaDir + "progressive.jpg");
  const std::string j = error_of([&] { decode_image(jpg.substr(0, jpg.size() / 2), "half.jpg"); });
  EXPECT_NE(j.find("half.jpg"), std::string::npos) << j;
  // libjpeg's words: "Premature end of JPEG file" (libjpeg-turbo 2.1), "Corrupt JPEG data:
  // premature end of data segment" (later ones).
  std::string lower = j;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  EXPECT_NE(lower.find("premature end"), std::string::npos) << j;

  const std::string bomb = error_of([&] { decode_image(png_header(100000, 100000), "bomb.png"); });
  EXPECT_NE(bomb.find("too large"), std::string::npos) << bomb;
  EXPECT_NE(bomb.find("bomb.png"), std::string::npos) << bomb;

  // baseline.jpg with its SOF0 dimensions patched to 60000 x 60000.
  std::string big = read_bytes(kMediaDir + "baseline.jpg");
  const size_t sof = big.find("\xFF\xC0");
  ASSERT_NE(sof, std::string::npos);
  big[sof + 5] = big[sof + 7] = static_cast<char>(0xEA);
  big[sof + 6] = big[sof + 8] = static_cast<char>(0x60);
  const std::string bj = error_of([&] { decode_image(big, "big.jpg"); });
  EXPECT_NE(bj.find("60000x60000"), std::string::npos) << bj;

  const std::string missing = error_of([] { load_image("/nonexistent/x.png"); });
  EXPECT_NE(missing.find("/nonexistent/x.png"), std::string::npos) << missing;
  EXPECT_NE(error_of([] { decode_image("", "empty.png"); }).find("empty.png"), std::string::npos);
  const std::string dir = kMediaDir;  // a folder where an image file was expected
  EXPECT_NE(error_of([&] { load_image(dir); }).find(": a directory, not an image file"),
            std::string::npos);
}

TEST(ImageDecode, RefusesProgressiveScanBombs) {
  // progressive.jpg with its first scan repeated 1100 times: libjpeg only warns about the bogus
  // progression, and each repeat costs a pass over the coefficients.
  const std::string jpg = read_bytes(kMediaDir + "progressive.jpg");
  const size_t sos = jpg.find("\xFF\xDA");
  ASSERT_NE(sos, std::string::npos);
  size_t end = sos + 2;
  for (;;) {  // the next marker that is neither a stuffed 0xFF00 nor a restart marker
    end = jpg.find('\xFF', end + 1);
    ASSERT_NE(end, std::string::npos);
    const auto m = static_cast<uint8_t>(jpg[end + 1]);
    if (m != 0 && (m < 0xD0 || m > 0xD7)) break;
  }
  std::string bomb = jpg.substr(0, end);
  for (int i = 0; i < 1100; ++i) bomb += jpg.substr(sos, end - sos);
  bomb += jpg.substr(end);
  const std::string e = error_of([&] { decode_image(bomb, "scans.jpg"); });
  EXPECT_NE(e.find("more than 1000 progressive scans"), std::string::npos) << e;
  EXPECT_NE(e.find("scans.jpg"), std::string::npos) << e;
}

// Every input saved by the fuzzer (fuzz/media_fuzz.cpp) decodes or throws weft::Error.
TEST(ImageDecode, ReplaysFuzzInputs) {
  int files = 0;
  for (const auto& e : fs::directory_iterator(fs::path(WEFT_SOURCE_DIR) / "tests/fuzz/media")) {
    const std::string bytes = read_bytes(e.path().string());
    try {
      const DecodedImage img = decode_image(bytes, e.path().filename().string());
      EXPECT_EQ(img.pixels.size(), static_cast<size_t>(img.width) * img.height * 3);
    } catch (const Error&) {
    }
    ++files;
  }
  EXPECT_GT(files, 0);
}

}  // namespace
}  // namespace weft::data
