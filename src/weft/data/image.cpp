#include "weft/data/image.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "weft/core/error.h"

namespace weft::data {

namespace {

// --- PIL's ImagingResample (libImaging/Resample.c), bicubic, 8 bits per channel -------------

constexpr int kPrecisionBits = 32 - 8 - 2;

double bicubic(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// Per output index: the first input index, how many inputs, and ksize fixed-point weights.
struct Coeffs {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> weights;
};

// precompute_coeffs + normalize_coeffs_8bpc.
Coeffs precompute_coeffs(int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = 2.0 * filterscale;  // bicubic support 2, widened when shrinking
  Coeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> k(c.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    const int xmin = std::max(static_cast<int>(center - support + 0.5), 0);
    const int xmax = std::min(static_cast<int>(center + support + 0.5), in_size) - xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      k[x] = bicubic((x + xmin - center + 0.5) * ss);
      ww += k[x];
    }
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[x] / ww : k[x];
      c.weights[static_cast<size_t>(xx) * c.ksize + x] = static_cast<int32_t>(
          w < 0 ? -0.5 + w * (1 << kPrecisionBits) : 0.5 + w * (1 << kPrecisionBits));
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

uint8_t clip8(int32_t v) {
  if (v >= (1 << kPrecisionBits << 8)) return 255;
  if (v <= 0) return 0;
  return static_cast<uint8_t>(v >> kPrecisionBits);
}

// Horizontal pass over input rows [row0, row0 + out.height).
void resample_horizontal(const DecodedImage& in, int row0, const Coeffs& c, DecodedImage& out) {
  for (int y = 0; y < out.height; ++y) {
    const uint8_t* src = in.pixels.data() + static_cast<size_t>(y + row0) * in.width * 3;
    uint8_t* dst = out.pixels.data() + static_cast<size_t>(y) * out.width * 3;
    for (int x = 0; x < out.width; ++x) {
      const int32_t* k = c.weights.data() + static_cast<size_t>(x) * c.ksize;
      const uint8_t* s = src + static_cast<size_t>(c.first[x]) * 3;
      int32_t s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
      for (int i = 0; i < c.count[x]; ++i, s += 3) {
        s0 += s[0] * k[i];
        s1 += s[1] * k[i];
        s2 += s[2] * k[i];
      }
      dst[x * 3 + 0] = clip8(s0);
      dst[x * 3 + 1] = clip8(s1);
      dst[x * 3 + 2] = clip8(s2);
    }
  }
}

// Vertical pass; c.first is relative to the first row of `in`.
void resample_vertical(const DecodedImage& in, const Coeffs& c, DecodedImage& out) {
  const size_t stride = static_cast<size_t>(in.width) * 3;
  for (int y = 0; y < out.height; ++y) {
    const int32_t* k = c.weights.data() + static_cast<size_t>(y) * c.ksize;
    const uint8_t* src = in.pixels.data() + static_cast<size_t>(c.first[y]) * stride;
    uint8_t* dst = out.pixels.data() + static_cast<size_t>(y) * stride;
    for (size_t x = 0; x < stride; ++x) {
      int32_t s = 1 << (kPrecisionBits - 1);
      for (int i = 0; i < c.count[y]; ++i) s += src[i * stride + x] * k[i];
      dst[x] = clip8(s);
    }
  }
}

DecodedImage blank(int width, int height) {
  DecodedImage img;
  img.width = width;
  img.height = height;
  img.pixels.assign(static_cast<size_t>(width) * height * 3, 0);
  return img;
}

void check_rgb(const DecodedImage& img, const char* where) {
  WEFT_CHECK(img.channels == 3 && img.width > 0 && img.height > 0 &&
                 img.pixels.size() == static_cast<size_t>(img.width) * img.height * 3,
             where, ": expected a non-empty RGB image with width * height * 3 bytes, got ",
             img.width, "x", img.height, "x", img.channels, " with ", img.pixels.size(), " bytes");
}

constexpr int64_t kMaxSide = 8192;

}  // namespace

ImageProcessor ImageProcessor::siglip(int64_t size) {
  ImageProcessor p;
  p.kind = Kind::kSiglip;
  p.size = size;
  p.crop = size;
  p.mean = {0.5, 0.5, 0.5};
  p.std = {0.5, 0.5, 0.5};
  return p;
}

DecodedImage resize_bicubic(const DecodedImage& img, int width, int height) {
  check_rgb(img, "resize_bicubic");
  WEFT_CHECK(width > 0 && height > 0 && width <= kMaxSide && height <= kMaxSide,
             "resize_bicubic: output size ", width, "x", height, " out of range [1, ", kMaxSide,
             "]");
  const bool horizontal = width != img.width, vertical = height != img.height;
  if (!horizontal && !vertical) return img;
  const Coeffs cx = precompute_coeffs(img.width, width);
  Coeffs cy = precompute_coeffs(img.height, height);
  if (!vertical) {
    DecodedImage out = blank(width, height);
    resample_horizontal(img, 0, cx, out);
    return out;
  }
  if (!horizontal) {
    DecodedImage out = blank(width, height);
    resample_vertical(img, cy, out);
    return out;
  }
  // Horizontal pass only over the rows the vertical pass reads, as PIL does.
  const int row0 = cy.first.front();
  const int row1 = cy.first.back() + cy.count.back();
  for (int& f : cy.first) f -= row0;
  DecodedImage tmp = blank(width, row1 - row0);
  resample_horizontal(img, row0, cx, tmp);
  DecodedImage out = blank(width, height);
  resample_vertical(tmp, cy, out);
  return out;
}

DecodedImage center_crop(const DecodedImage& img, int width, int height) {
  check_rgb(img, "center_crop");
  WEFT_CHECK(width > 0 && height > 0 && width <= kMaxSide && height <= kMaxSide,
             "center_crop: output size ", width, "x", height, " out of range [1, ", kMaxSide, "]");
  // Python's (in - out) // 2 rounds towards -inf; a negative offset is the zero padding.
  auto floor_half = [](int d) { return d >= 0 ? d / 2 : -((-d + 1) / 2); };
  const int top = floor_half(img.height - height), left = floor_half(img.width - width);
  DecodedImage out = blank(width, height);
  for (int y = 0; y < height; ++y) {
    const int sy = y + top;
    if (sy < 0 || sy >= img.height) continue;
    const int x0 = std::max(0, -left), x1 = std::min(width, img.width - left);
    if (x0 >= x1) continue;
    std::copy_n(img.pixels.data() + (static_cast<size_t>(sy) * img.width + x0 + left) * 3,
                static_cast<size_t>(x1 - x0) * 3,
                out.pixels.data() + (static_cast<size_t>(y) * width + x0) * 3);
  }
  return out;
}

DecodedImage expand_to_square(const DecodedImage& img, const std::array<uint8_t, 3>& background) {
  check_rgb(img, "expand_to_square");
  if (img.width == img.height) return img;
  const int side = std::max(img.width, img.height);
  DecodedImage out = blank(side, side);
  for (size_t i = 0; i < out.pixels.size(); i += 3)
    std::copy(background.begin(), background.end(), out.pixels.begin() + i);
  const int x0 = (side - img.width) / 2, y0 = (side - img.height) / 2;
  for (int y = 0; y < img.height; ++y)
    std::copy_n(img.pixels.data() + static_cast<size_t>(y) * img.width * 3,
                static_cast<size_t>(img.width) * 3,
                out.pixels.data() + (static_cast<size_t>(y + y0) * side + x0) * 3);
  return out;
}

DecodedImage resize_and_crop(const DecodedImage& img, const ImageProcessor& p) {
  const bool clip = p.kind == ImageProcessor::Kind::kClip;
  WEFT_CHECK(p.size >= 1 && p.size <= kMaxSide, "image processor: size = ", p.size,
             " out of range [1, ", kMaxSide, "]");
  WEFT_CHECK(!clip || (p.crop >= 1 && p.crop <= kMaxSide), "image processor: crop = ", p.crop,
             " out of range [1, ", kMaxSide, "]");
  check_rgb(img, "image processor");
  DecodedImage src = img;
  if (p.pad_to_square) {
    std::array<uint8_t, 3> background{};
    for (int c = 0; c < 3; ++c) {
      WEFT_CHECK(p.mean[c] >= 0.0 && p.mean[c] <= 1.0, "image processor: mean[", c,
                 "] = ", p.mean[c], " must be in [0, 1] to pad with the mean colour");
      background[c] = static_cast<uint8_t>(p.mean[c] * 255);  // Python int(): truncation
    }
    src = expand_to_square(img, background);
  }
  if (!clip) return resize_bicubic(src, static_cast<int>(p.size), static_cast<int>(p.size));
  // HF get_resize_output_image_size(default_to_square=False): the long side becomes
  // int(size * long / short), a float division truncated.
  const int64_t w = src.width, h = src.height;
  const int64_t short_side = std::min(w, h), long_side = std::max(w, h);
  const auto new_long = static_cast<int64_t>(static_cast<double>(p.size * long_side) /
                                             static_cast<double>(short_side));
  WEFT_CHECK(new_long <= 4 * kMaxSide, "image processor: a ", w, "x", h,
             " image resized to shortest edge ", p.size, " would be ", new_long,
             " pixels long (limit ", 4 * kMaxSide, ")");
  const int rw = static_cast<int>(w <= h ? p.size : new_long);
  const int rh = static_cast<int>(w <= h ? new_long : p.size);
  return center_crop(resize_bicubic(src, rw, rh), static_cast<int>(p.crop),
                     static_cast<int>(p.crop));
}

at::Tensor preprocess_image(const DecodedImage& img, const ImageProcessor& p) {
  for (int c = 0; c < 3; ++c)
    WEFT_CHECK(p.std[c] != 0.0, "image processor: std[", c, "] must not be 0");
  const DecodedImage u8 = resize_and_crop(img, p);
  const int64_t plane = static_cast<int64_t>(u8.width) * u8.height;
  auto out = torch::empty({3, u8.height, u8.width}, torch::kFloat);
  float* o = out.data_ptr<float>();
  for (int c = 0; c < 3; ++c) {
    // HF: rescale in float64 then cast to float32; normalize in float32.
    const auto mean = static_cast<float>(p.mean[c]), std = static_cast<float>(p.std[c]);
    for (int64_t i = 0; i < plane; ++i) {
      const auto v = static_cast<float>(u8.pixels[i * 3 + c] * (1.0 / 255.0));
      o[c * plane + i] = (v - mean) / std;
    }
  }
  return out;
}

}  // namespace weft::data
