// JPEG and PNG files -> upright 8-bit RGB, as edge_client/images.py's load_image gives them to
// preprocessing: EXIF orientation applied (JPEG), alpha dropped (not composited), grey and palette
// expanded, 16-bit PNG samples cut to their high byte (Pillow's "RGB" reading of them).
// What differs from Pillow is listed in docs/howto/cpp-libtorch.md.
#pragma once

#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <jpeglib.h>
#include <jerror.h>
#include <png.h>

namespace fedmvp {

struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<unsigned char> rgb;  // row-major, 3 bytes a pixel
};

constexpr long long kMaxPixels = 100000000LL;  // edge_client/images.py DEFAULT_MAX_PIXELS

namespace detail {

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

inline void jpeg_fail(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings are silent, except a file that ends early: Pillow refuses a truncated image, libjpeg would
// pad it with grey.
inline void jpeg_warning(j_common_ptr cinfo, int level) {
  if (level == -1 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
    auto* err = reinterpret_cast<JpegError*>(cinfo->err);
    std::snprintf(err->message, sizeof err->message, "truncated image");
    std::longjmp(err->jump, 1);
  }
}

// The EXIF orientation (1..8) in an APP1 "Exif" segment, 1 when absent or unreadable.
inline int exif_orientation(const unsigned char* d, size_t n) {
  if (n < 14 || std::memcmp(d, "Exif\0\0", 6) != 0) return 1;
  d += 6; n -= 6;
  bool le = d[0] == 'I' && d[1] == 'I';
  if (!le && !(d[0] == 'M' && d[1] == 'M')) return 1;
  auto u16 = [&](size_t o) -> unsigned { return le ? d[o] | d[o + 1] << 8 : d[o] << 8 | d[o + 1]; };
  auto u32 = [&](size_t o) -> size_t {
    return le ? size_t(d[o]) | size_t(d[o + 1]) << 8 | size_t(d[o + 2]) << 16 | size_t(d[o + 3]) << 24
              : size_t(d[o]) << 24 | size_t(d[o + 1]) << 16 | size_t(d[o + 2]) << 8 | size_t(d[o + 3]);
  };
  size_t ifd = u32(4);
  if (ifd + 2 > n) return 1;
  unsigned count = u16(ifd);
  for (unsigned i = 0; i < count; ++i) {
    size_t e = ifd + 2 + 12 * size_t(i);
    if (e + 12 > n) return 1;
    if (u16(e) == 0x0112 && u16(e + 2) == 3) {
      unsigned v = u16(e + 8);
      return v >= 1 && v <= 8 ? int(v) : 1;
    }
  }
  return 1;
}

// PIL.ImageOps.exif_transpose's transposes for orientations 2..8.
inline RgbImage apply_orientation(const RgbImage& in, int orientation) {
  if (orientation <= 1) return in;
  const int W = in.width, H = in.height;
  const bool swap = orientation >= 5;
  RgbImage out;
  out.width = swap ? H : W;
  out.height = swap ? W : H;
  out.rgb.resize(in.rgb.size());
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      int sx = x, sy = y;
      switch (orientation) {
        case 2: sx = W - 1 - x; break;                  // FLIP_LEFT_RIGHT
        case 3: sx = W - 1 - x; sy = H - 1 - y; break;  // ROTATE_180
        case 4: sy = H - 1 - y; break;                  // FLIP_TOP_BOTTOM
        case 5: sx = y; sy = x; break;                  // TRANSPOSE
        case 6: sx = y; sy = H - 1 - x; break;          // ROTATE_270
        case 7: sx = W - 1 - y; sy = H - 1 - x; break;  // TRANSVERSE
        case 8: sx = W - 1 - y; sy = x; break;          // ROTATE_90
      }
      std::memcpy(&out.rgb[(size_t(y) * out.width + x) * 3], &in.rgb[(size_t(sy) * W + sx) * 3], 3);
    }
  }
  return out;
}

inline RgbImage decode_jpeg(const std::string& path, FILE* f) {
  jpeg_decompress_struct cinfo;
  JpegError err;
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_fail;
  err.mgr.emit_message = jpeg_warning;
  RgbImage img;
  int orientation = 1;
  if (setjmp(err.jump)) {
    jpeg_destroy_decompress(&cinfo);
    throw std::runtime_error(path + ": corrupt JPEG (" + err.message + ")");
  }
  jpeg_create_decompress(&cinfo);
  jpeg_stdio_src(&cinfo, f);
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&cinfo, TRUE);
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m; m = m->next)
    if (m->marker == JPEG_APP0 + 1 && orientation == 1) orientation = exif_orientation(m->data, m->data_length);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    jpeg_destroy_decompress(&cinfo);
    throw std::runtime_error(path + ": CMYK JPEG is not supported here (edge-client reads it)");
  }
  if ((long long)cinfo.image_width * cinfo.image_height > kMaxPixels) {
    jpeg_destroy_decompress(&cinfo);
    throw std::runtime_error(path + ": too many pixels");
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  img.width = int(cinfo.output_width);
  img.height = int(cinfo.output_height);
  img.rgb.resize(size_t(img.width) * img.height * 3);
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = &img.rgb[size_t(cinfo.output_scanline) * img.width * 3];
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return apply_orientation(img, orientation);
}

struct PngFail {
  std::jmp_buf jump;
  char message[256] = "";
};

inline void png_fail(png_structp png, png_const_charp msg) {
  auto* f = static_cast<PngFail*>(png_get_error_ptr(png));
  std::snprintf(f->message, sizeof f->message, "%s", msg);
  std::longjmp(f->jump, 1);
}

inline void png_quiet(png_structp, png_const_charp) {}

inline RgbImage decode_png(const std::string& path, FILE* f) {
  PngFail fail;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &fail, png_fail, png_quiet);
  if (!png) throw std::runtime_error(path + ": out of memory");
  png_infop info = png_create_info_struct(png);
  RgbImage img;
  std::vector<png_bytep> rows;
  if (setjmp(fail.jump)) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw std::runtime_error(path + ": corrupt PNG (" + fail.message + ")");
  }
  png_init_io(png, f);
  png_set_user_limits(png, 1000000, 1000000);
  png_read_info(png, info);
  png_uint_32 w = png_get_image_width(png, info), h = png_get_image_height(png, info);
  if ((long long)w * h > kMaxPixels) png_error(png, "too many pixels");
  int type = png_get_color_type(png, info);
  if (png_get_bit_depth(png, info) == 16) png_set_strip_16(png);
  if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (type == PNG_COLOR_TYPE_GRAY && png_get_bit_depth(png, info) < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (type == PNG_COLOR_TYPE_GRAY || type == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
  png_set_strip_alpha(png);  // also drops a tRNS-made alpha: Pillow's convert("RGB") ignores it
  if (png_get_interlace_type(png, info) != PNG_INTERLACE_NONE) png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != size_t(w) * 3) png_error(png, "unexpected row layout");
  img.width = int(w);
  img.height = int(h);
  img.rgb.resize(size_t(w) * h * 3);
  rows.resize(h);
  for (png_uint_32 y = 0; y < h; ++y) rows[y] = &img.rgb[size_t(y) * w * 3];
  png_read_image(png, rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  return img;
}

}  // namespace detail

// Decode a JPEG or PNG file (recognised by its first bytes) to upright RGB.
inline RgbImage decode_image(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error(path + ": cannot open (" + std::strerror(errno) + ")");
  unsigned char magic[8] = {0};
  size_t got = std::fread(magic, 1, 8, f);
  std::rewind(f);
  try {
    RgbImage img;
    if (got == 0) throw std::runtime_error(path + ": empty file");
    if (got >= 3 && magic[0] == 0xFF && magic[1] == 0xD8 && magic[2] == 0xFF) img = detail::decode_jpeg(path, f);
    else if (got == 8 && png_sig_cmp(magic, 0, 8) == 0) img = detail::decode_png(path, f);
    else throw std::runtime_error(path + ": not a JPEG or PNG file");
    std::fclose(f);
    return img;
  } catch (...) {
    std::fclose(f);
    throw;
  }
}

}  // namespace fedmvp
