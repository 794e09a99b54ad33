// Image preprocessing for vision encoders, matching the Hugging Face processors run on PIL images:
//   CLIPImageProcessor:   resize the shortest edge to `size` (PIL bicubic), center crop
//                         crop x crop, rescale by 1/255, normalise with mean/std;
//   SiglipImageProcessor: resize to size x size (PIL bicubic), rescale, normalise (0.5, 0.5);
//   LLaVA's image_aspect_ratio = "pad": before either, pad the image to a square with the mean
//                         colour (expand2square, background int(mean * 255)).
// The resize reproduces PIL's ImagingResample (separable passes, antialiasing support scaled by
// the downscale factor, 22-bit fixed-point weights, uint8 rounding after each pass), so the uint8
// image before rescaling is the one PIL gives. Decoding is in image_decode.h. All functions are
// pure and thread-safe.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

#include "weft/data/image_decode.h"

namespace weft::data {

struct ImageProcessor {  // defaults: the openai/clip-vit-* processors at 224 (use 336 for L/14-336)
  enum class Kind { kClip, kSiglip };
  Kind kind = Kind::kClip;
  int64_t size = 224;  // clip: shortest edge after resizing; siglip: output side
  int64_t crop = 224;  // clip only: center crop side
  bool pad_to_square = false;
  std::array<double, 3> mean{0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> std{0.26862954, 0.26130258, 0.27577711};

  // google/siglip-* processor: size x size, mean = std = 0.5.
  static ImageProcessor siglip(int64_t size = 224);
  // Side of the square output.
  int64_t output_size() const { return kind == Kind::kClip ? crop : size; }
};

// PIL's Image.resize((width, height), Image.BICUBIC) on an RGB image.
DecodedImage resize_bicubic(const DecodedImage& img, int width, int height);

// HF image_transforms.center_crop: the centred width x height window, top/left =
// floor((in - out) / 2); where the image is smaller the window is padded with zeros.
DecodedImage center_crop(const DecodedImage& img, int width, int height);

// LLaVA's expand2square: the image pasted at the centre (offset floor((side - w) / 2)) of a
// square of `background`.
DecodedImage expand_to_square(const DecodedImage& img, const std::array<uint8_t, 3>& background);

// The uint8 image after padding, resizing and cropping: what the HF processor holds just before
// rescaling. Throws weft::Error on a bad processor (sizes < 1 or > 8192, std == 0).
DecodedImage resize_and_crop(const DecodedImage& img, const ImageProcessor& p);

// The model input: float32 [3, side, side] with side = p.output_size(), values
// (pixel / 255 - mean) / std computed in float32 as HF's rescale + normalize.
at::Tensor preprocess_image(const DecodedImage& img, const ImageProcessor& p);

}  // namespace weft::data
