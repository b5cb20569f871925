// The manifest's "preprocess" section, as edge_client/preprocess.py applies it: torchvision's
// shorter-side Resize (Pillow's resampler, reproduced here: same filter, same 22-bit fixed-point
// coefficients, horizontal pass then vertical, uint8 in between), CenterCrop with round-half-even
// offsets, then ToTensor and Normalize in float32.
#pragma once

#include <cfenv>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "decode.hpp"
#include "json.hpp"

namespace fedmvp {

struct PreprocessSpec {
  int image_size = 224;
  float mean[3] = {0.48145466f, 0.4578275f, 0.40821073f};
  float std[3] = {0.26862954f, 0.26130258f, 0.27577711f};
  bool bicubic = true;  // "bicubic-shortest-side", else "bilinear-shortest-side"

  static PreprocessSpec from_manifest(const Json& p) {
    PreprocessSpec s;
    const Json& size = p.at("image_size");
    double v = size.kind == Json::Kind::Array ? size.arr().at(0).num() : size.num();
    if (size.kind == Json::Kind::Array && (size.arr().size() != 2 || size.arr()[1].num() != v))
      throw std::runtime_error("preprocess.image_size: only a square size is supported");
    if (v < 1 || v > 4096 || v != double(int(v))) throw std::runtime_error("preprocess.image_size: bad value");
    s.image_size = int(v);
    if (p.has("resize")) {
      const std::string& r = p.at("resize").str();
      if (r != "bicubic-shortest-side" && r != "bilinear-shortest-side")
        throw std::runtime_error("preprocess.resize: unsupported '" + r + "'");
      s.bicubic = r == "bicubic-shortest-side";
    }
    if (p.has("crop") && p.at("crop").str() != "center")
      throw std::runtime_error("preprocess.crop: unsupported '" + p.at("crop").str() + "'");
    for (const char* key : {"mean", "std"}) {
      if (!p.has(key)) continue;
      const auto& a = p.at(key).arr();
      if (a.size() != 3) throw std::runtime_error(std::string("preprocess.") + key + ": needs 3 values");
      for (int c = 0; c < 3; ++c) (key[0] == 'm' ? s.mean : s.std)[c] = float(a[size_t(c)].num());
    }
    for (float sd : s.std)
      if (!(sd > 0)) throw std::runtime_error("preprocess.std: values must be > 0");
    return s;
  }
};

namespace detail {

constexpr int kPrecisionBits = 32 - 8 - 2;  // Pillow's Resample.c PRECISION_BITS

inline double bicubic_filter(double x) {  // Pillow: a = -0.5
  const double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

inline double bilinear_filter(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

// Pillow's precompute_coeffs + normalize_coeffs_8bpc for one axis: per output index its first input
// index, its tap count and ksize fixed-point weights.
struct Coeffs {
  int ksize = 0;
  std::vector<int> bounds;  // (xmin, count) per output
  std::vector<int> k;       // outSize * ksize
};

inline Coeffs precompute(int in_size, int out_size, bool bicubic) {
  double (*filter)(double) = bicubic ? bicubic_filter : bilinear_filter;
  const double support0 = bicubic ? 2.0 : 1.0;
  double scale = double(float(in_size) - 0.0f) / out_size, filterscale = scale;
  if (filterscale < 1.0) filterscale = 1.0;
  const double support = support0 * filterscale;
  Coeffs c;
  c.ksize = int(std::ceil(support)) * 2 + 1;
  c.bounds.resize(size_t(out_size) * 2);
  c.k.assign(size_t(out_size) * c.ksize, 0);
  std::vector<double> w(size_t(c.ksize));
  for (int xx = 0; xx < out_size; ++xx) {
    double center = 0.0 + (xx + 0.5) * scale, ww = 0.0, ss = 1.0 / filterscale;
    int xmin = int(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = int(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    for (int x = 0; x < xmax; ++x) { w[size_t(x)] = filter((x + xmin - center + 0.5) * ss); ww += w[size_t(x)]; }
    for (int x = 0; x < xmax; ++x) {
      double v = ww != 0.0 ? w[size_t(x)] / ww : w[size_t(x)];
      c.k[size_t(xx) * c.ksize + x] = v < 0 ? int(-0.5 + v * (1 << kPrecisionBits)) : int(0.5 + v * (1 << kPrecisionBits));
    }
    c.bounds[size_t(xx) * 2] = xmin;
    c.bounds[size_t(xx) * 2 + 1] = xmax;
  }
  return c;
}

inline unsigned char clip8(long long v) {
  if (v >= (1LL << kPrecisionBits << 8)) return 255;
  if (v <= 0) return 0;
  return static_cast<unsigned char>(v >> kPrecisionBits);
}

}  // namespace detail

// PIL Image.resize((w, h), BICUBIC|BILINEAR) on an RGB image, bit for bit.
inline RgbImage pillow_resize(const RgbImage& in, int out_w, int out_h, bool bicubic) {
  using namespace detail;
  if (out_w == in.width && out_h == in.height) return in;
  Coeffs hc = precompute(in.width, out_w, bicubic), vc = precompute(in.height, out_h, bicubic);
  const int ybox_first = vc.bounds[0];
  const int ybox_last = vc.bounds[size_t(out_h) * 2 - 2] + vc.bounds[size_t(out_h) * 2 - 1];
  const RgbImage* src = &in;
  RgbImage tmp, out;
  if (out_w != in.width) {  // horizontal pass over the rows the vertical pass reads
    for (int i = 0; i < out_h; ++i) vc.bounds[size_t(i) * 2] -= ybox_first;
    tmp.width = out_w;
    tmp.height = ybox_last - ybox_first;
    tmp.rgb.resize(size_t(tmp.width) * tmp.height * 3);
    for (int yy = 0; yy < tmp.height; ++yy) {
      const unsigned char* row = &in.rgb[size_t(yy + ybox_first) * in.width * 3];
      for (int xx = 0; xx < out_w; ++xx) {
        const int xmin = hc.bounds[size_t(xx) * 2], n = hc.bounds[size_t(xx) * 2 + 1];
        const int* k = &hc.k[size_t(xx) * hc.ksize];
        long long s[3] = {1LL << (kPrecisionBits - 1), 1LL << (kPrecisionBits - 1), 1LL << (kPrecisionBits - 1)};
        for (int x = 0; x < n; ++x)
          for (int ch = 0; ch < 3; ++ch) s[ch] += (long long)row[size_t(x + xmin) * 3 + ch] * k[x];
        for (int ch = 0; ch < 3; ++ch) tmp.rgb[(size_t(yy) * out_w + xx) * 3 + ch] = clip8(s[ch]);
      }
    }
    src = &tmp;
  }
  if (out_h == in.height) return tmp;  // Pillow skips the vertical pass when the height is unchanged
  out.width = src->width;
  out.height = out_h;
  out.rgb.resize(size_t(out.width) * out_h * 3);
  for (int yy = 0; yy < out_h; ++yy) {
    const int ymin = vc.bounds[size_t(yy) * 2], n = vc.bounds[size_t(yy) * 2 + 1];
    const int* k = &vc.k[size_t(yy) * vc.ksize];
    for (int xx = 0; xx < out.width; ++xx) {
      long long s[3] = {1LL << (kPrecisionBits - 1), 1LL << (kPrecisionBits - 1), 1LL << (kPrecisionBits - 1)};
      for (int y = 0; y < n; ++y)
        for (int ch = 0; ch < 3; ++ch) s[ch] += (long long)src->rgb[(size_t(y + ymin) * out.width + xx) * 3 + ch] * k[y];
      for (int ch = 0; ch < 3; ++ch) out.rgb[(size_t(yy) * out.width + xx) * 3 + ch] = clip8(s[ch]);
    }
  }
  return out;
}

// torchvision Resize(size) then CenterCrop(size): uint8 RGB [size, size, 3] (edge_client resize_crop_rgb).
inline std::vector<unsigned char> resize_crop(const RgbImage& img, const PreprocessSpec& spec) {
  const int size = spec.image_size;
  const bool w_short = img.width <= img.height;
  const int shorter = w_short ? img.width : img.height, longer = w_short ? img.height : img.width;
  const int new_long = int(double(size) * longer / shorter);  // Python's int(size * long / short)
  const int new_w = w_short ? size : new_long, new_h = w_short ? new_long : size;
  RgbImage r = pillow_resize(img, new_w, new_h, spec.bicubic);
  if (r.width < size || r.height < size) throw std::runtime_error("image smaller than the crop after resizing");
  std::fesetround(FE_TONEAREST);  // Python's round(): half to even
  const int top = int(std::nearbyint((r.height - size) / 2.0)), left = int(std::nearbyint((r.width - size) / 2.0));
  std::vector<unsigned char> out(size_t(size) * size * 3);
  for (int y = 0; y < size; ++y)
    std::memcpy(&out[size_t(y) * size * 3], &r.rgb[(size_t(y + top) * r.width + left) * 3], size_t(size) * 3);
  return out;
}

// uint8 [S, S, 3] -> float32 [3, S, S] written at dst: ToTensor and Normalize in float32.
inline void normalise_into(const unsigned char* pixels, const PreprocessSpec& spec, float* dst) {
  const int S = spec.image_size;
  for (int ch = 0; ch < 3; ++ch)
    for (int i = 0; i < S * S; ++i) {
      volatile float x = float(pixels[size_t(i) * 3 + ch]) / 255.0f;  // no fused or reordered float math
      dst[size_t(ch) * S * S + i] = (x - spec.mean[ch]) / spec.std[ch];
    }
}

}  // namespace fedmvp
