#include "weft/data/image_decode.h"

#include <png.h>

#include <algorithm>
#include <csetjmp>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

// jpeglib.h needs FILE and size_t declared first.
#include <jerror.h>
#include <jpeglib.h>

#include "weft/core/error.h"

// libpng and libjpeg report errors through callbacks that must not return. They longjmp back to
// a setjmp in a small step function whose frame holds no C++ object with a destructor; the step
// returns false and the caller throws weft::Error, so the RAII owner frees the decoder state.

namespace weft::data {

namespace {

constexpr size_t kMaxMessage = 200;

void check_size(int64_t width, int64_t height, const std::string& name, const char* format) {
  WEFT_CHECK(width > 0 && height > 0, "image ", name, ": ", format, " has zero size (", width, "x",
             height, ")");
  WEFT_CHECK(width * height * 3 <= kMaxImageBytes, "image ", name, ": ", format, " of ", width, "x",
             height, " pixels is too large (", width * height * 3, " bytes of RGB, limit ",
             kMaxImageBytes, "; a decompression bomb?)");
}

// --- PNG -------------------------------------------------------------------------------------

struct PngSource {
  const uint8_t* data;
  size_t size;
  size_t pos;
};

struct PngReader {
  png_structp png = nullptr;
  png_infop info = nullptr;
  PngSource source{};
  char message[kMaxMessage] = "";

  ~PngReader() {
    if (png) png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
  }
};

[[noreturn]] void png_fail(png_structp png, png_const_charp msg) {
  auto* r = static_cast<PngReader*>(png_get_error_ptr(png));
  std::snprintf(r->message, sizeof(r->message), "%s", msg);
  png_longjmp(png, 1);
}

void png_warn(png_structp, png_const_charp) {}  // benign (bad CRC in an ancillary chunk, ...)

void png_read_bytes(png_structp png, png_bytep out, size_t n) {
  auto* s = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > s->size - s->pos) png_error(png, "truncated file (unexpected end of data)");
  std::memcpy(out, s->data + s->pos, n);
  s->pos += n;
}

// Reads the header and sets the transforms: palette -> RGB, 1/2/4-bit gray -> 8-bit, 16 -> 8 bits
// by the high byte. Gray/alpha channels are converted by the caller (png_get_channels()).
bool png_start(PngReader* r) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_set_read_fn(r->png, &r->source, png_read_bytes);
  png_set_chunk_malloc_max(r->png, 16u << 20);  // zTXt / iCCP / iTXt inflate to at most 16 MiB
  png_read_info(r->png, r->info);
  const int color = png_get_color_type(r->png, r->info);
  const int depth = png_get_bit_depth(r->png, r->info);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(r->png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(r->png);
  if (depth == 16) png_set_strip_16(r->png);
  png_set_interlace_handling(r->png);
  png_read_update_info(r->png, r->info);
  return true;
}

bool png_rows(PngReader* r, png_bytepp rows) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_read_image(r->png, rows);
  return true;
}

bool png_row(PngReader* r, png_bytep row) {
  if (setjmp(png_jmpbuf(r->png))) return false;
  png_read_row(r->png, row, nullptr);
  return true;
}

// One row of `channels` (1 gray, 2 gray+alpha, 3 RGB, 4 RGBA) 8-bit samples -> RGB.
void to_rgb(const uint8_t* in, int channels, int width, uint8_t* out) {
  for (int x = 0; x < width; ++x, in += channels, out += 3) {
    if (channels <= 2) {
      out[0] = out[1] = out[2] = in[0];
    } else {
      out[0] = in[0];
      out[1] = in[1];
      out[2] = in[2];
    }
  }
}

DecodedImage decode_png(std::string_view bytes, const std::string& name) {
  PngReader r;
  r.source = {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), 0};
  r.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &r, png_fail, png_warn);
  WEFT_CHECK(r.png, "image ", name, ": cannot create a PNG decoder (out of memory?)");
  r.info = png_create_info_struct(r.png);
  WEFT_CHECK(r.info, "image ", name, ": cannot create a PNG decoder (out of memory?)");
  WEFT_CHECK(png_start(&r), "image ", name, ": bad PNG: ", r.message);

  const int64_t width = png_get_image_width(r.png, r.info);
  const int64_t height = png_get_image_height(r.png, r.info);
  check_size(width, height, name, "PNG");
  const int channels = png_get_channels(r.png, r.info);
  const size_t row_bytes = png_get_rowbytes(r.png, r.info);
  WEFT_ASSERT(channels >= 1 && channels <= 4 && row_bytes == static_cast<size_t>(width) * channels,
              "PNG transforms gave ", channels, " channels and ", row_bytes, " bytes per row");

  DecodedImage img;
  img.width = static_cast<int>(width);
  img.height = static_cast<int>(height);
  const size_t out_row = static_cast<size_t>(width) * 3;
  if (png_get_interlace_type(r.png, r.info) == PNG_INTERLACE_NONE) {
    // Row by row: a file that promises a huge image but ends early fails before the memory is
    // touched (reserve() only maps it).
    std::vector<uint8_t> row(row_bytes);
    img.pixels.reserve(out_row * static_cast<size_t>(height));
    for (int64_t y = 0; y < height; ++y) {
      WEFT_CHECK(png_row(&r, row.data()), "image ", name, ": bad PNG at row ", y, ": ", r.message);
      img.pixels.resize(img.pixels.size() + out_row);
      to_rgb(row.data(), channels, img.width, img.pixels.data() + y * out_row);
    }
  } else {  // Adam7 needs the whole image in memory
    std::vector<uint8_t> raw(row_bytes * static_cast<size_t>(height));
    std::vector<png_bytep> rows(static_cast<size_t>(height));
    for (int64_t y = 0; y < height; ++y) rows[y] = raw.data() + y * row_bytes;
    WEFT_CHECK(png_rows(&r, rows.data()), "image ", name, ": bad PNG: ", r.message);
    img.pixels.resize(out_row * static_cast<size_t>(height));
    for (int64_t y = 0; y < height; ++y)
      to_rgb(rows[y], channels, img.width, img.pixels.data() + y * out_row);
  }
  return img;
}

// --- JPEG ------------------------------------------------------------------------------------

struct JpegError {
  jpeg_error_mgr mgr;  // first member: libjpeg hands back &mgr as cinfo->err
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX > kMaxMessage ? JMSG_LENGTH_MAX : kMaxMessage];
};

[[noreturn]] void jpeg_fail(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings about corrupt data are ignored, as PIL does; running out of data is an error (PIL:
// "image file is truncated").
void jpeg_emit(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) jpeg_fail(cinfo);
}

void jpeg_quiet(j_common_ptr) {}

void jpeg_progress(j_common_ptr cinfo) {
  if (!cinfo->is_decompressor) return;
  const int scans = reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number;
  if (scans <= kMaxJpegScans) return;
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  std::snprintf(err->message, sizeof(err->message), "more than %d progressive scans (a scan bomb?)",
                kMaxJpegScans);
  std::longjmp(err->jump, 1);
}

struct JpegReader {
  jpeg_decompress_struct cinfo;
  JpegError err;
  jpeg_progress_mgr progress;
  bool created = false;

  JpegReader() {
    std::memset(&cinfo, 0, sizeof(cinfo));
    std::memset(&progress, 0, sizeof(progress));
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = jpeg_fail;
    err.mgr.emit_message = jpeg_emit;
    err.mgr.output_message = jpeg_quiet;
    err.message[0] = '\0';
    progress.progress_monitor = jpeg_progress;
  }
  ~JpegReader() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

bool jpeg_header(JpegReader* r, const uint8_t* data, size_t size) {
  if (setjmp(r->err.jump)) return false;
  jpeg_create_decompress(&r->cinfo);
  r->created = true;
  r->cinfo.progress = &r->progress;
  // Progressive files buffer all coefficients (2 bytes per sample); cap libjpeg's memory.
  r->cinfo.mem->max_memory_to_use = 4 * kMaxImageBytes;
  jpeg_mem_src(&r->cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&r->cinfo, TRUE);
  const J_COLOR_SPACE in = r->cinfo.jpeg_color_space;
  r->cinfo.out_color_space = in == JCS_GRAYSCALE                ? JCS_GRAYSCALE
                             : in == JCS_CMYK || in == JCS_YCCK ? JCS_CMYK
                                                                : JCS_RGB;
  return true;
}

bool jpeg_start(JpegReader* r) {
  if (setjmp(r->err.jump)) return false;
  jpeg_start_decompress(&r->cinfo);
  return true;
}

bool jpeg_row(JpegReader* r, JSAMPROW row) {
  if (setjmp(r->err.jump)) return false;
  if (jpeg_read_scanlines(&r->cinfo, &row, 1) == 1) return true;
  std::snprintf(r->err.message, sizeof(r->err.message), "no scanline returned");
  return false;
}

// PIL's cmyk2rgb on inverted (Adobe) CMYK, which is what libjpeg returns and PIL assumes.
void cmyk_to_rgb(const uint8_t* in, int width, uint8_t* out) {
  for (int x = 0; x < width; ++x, in += 4, out += 3) {
    const int nk = in[3];  // 255 - K
    for (int c = 0; c < 3; ++c) {
      const int t = (255 - in[c]) * nk + 128;  // MULDIV255(C, 255 - K)
      out[c] = static_cast<uint8_t>(std::clamp(nk - (((t >> 8) + t) >> 8), 0, 255));
    }
  }
}

DecodedImage decode_jpeg(std::string_view bytes, const std::string& name) {
  JpegReader r;
  WEFT_CHECK(jpeg_header(&r, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
             "image ", name, ": bad JPEG: ", r.err.message);
  check_size(r.cinfo.image_width, r.cinfo.image_height, name, "JPEG");
  WEFT_CHECK(jpeg_start(&r), "image ", name, ": bad JPEG: ", r.err.message);
  const int channels = r.cinfo.output_components;
  const int width = static_cast<int>(r.cinfo.output_width);
  const int height = static_cast<int>(r.cinfo.output_height);
  WEFT_ASSERT((channels == 1 || channels == 3 || channels == 4) && width > 0 && height > 0,
              "libjpeg output ", width, "x", height, "x", channels);

  DecodedImage img;
  img.width = width;
  img.height = height;
  const size_t out_row = static_cast<size_t>(width) * 3;
  std::vector<uint8_t> row(static_cast<size_t>(width) * channels);
  img.pixels.reserve(out_row * static_cast<size_t>(height));
  for (int y = 0; y < height; ++y) {
    WEFT_CHECK(jpeg_row(&r, row.data()), "image ", name, ": bad JPEG at row ", y, ": ",
               r.err.message);
    img.pixels.resize(img.pixels.size() + out_row);
    uint8_t* out = img.pixels.data() + y * out_row;
    if (channels == 4)
      cmyk_to_rgb(row.data(), width, out);
    else if (channels == 1)
      to_rgb(row.data(), 1, width, out);
    else
      std::memcpy(out, row.data(), out_row);
  }
  // Trailing data after the last scanline (and a missing EOI) is ignored, as in PIL.
  return img;
}

}  // namespace

DecodedImage decode_image(std::string_view bytes, const std::string& name) {
  static constexpr uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() >= 8 && std::memcmp(b, kPng, 8) == 0) return decode_png(bytes, name);
  if (bytes.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF)
    return decode_jpeg(bytes, name);
  WEFT_FAIL("image ", name, ": not a PNG or JPEG file (", bytes.size(),
            " bytes; the supported image formats are PNG and JPEG, recognised by their first "
            "bytes)");
}

DecodedImage load_image(const std::string& path) {
  std::error_code ec;
  WEFT_CHECK(!std::filesystem::is_directory(path, ec), "image ", path,
             ": a directory, not an image file");
  std::ifstream f(path, std::ios::binary);
  WEFT_CHECK(f, "image ", path, ": cannot open the file");
  std::ostringstream ss;
  ss << f.rdbuf();
  WEFT_CHECK(!f.bad(), "image ", path, ": read error");
  return decode_image(ss.str(), path);
}

}  // namespace weft::data
