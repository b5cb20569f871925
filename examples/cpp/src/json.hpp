// A minimal JSON reader for the bundle's manifest.json and safetensors headers.
// Why not a library: the example must build with nothing but the torch wheel, libjpeg and libpng
// (docs/howto/cpp-libtorch.md). It parses RFC 8259 JSON into a small tree and refuses anything else.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fedmvp {

struct Json {
  enum class Kind { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  double number = 0.0;
  std::string text;
  std::vector<Json> items;
  std::map<std::string, Json> fields;

  bool is_object() const { return kind == Kind::Object; }
  bool has(const std::string& key) const { return is_object() && fields.count(key) > 0; }
  const Json& at(const std::string& key) const {
    if (!is_object()) throw std::runtime_error("expected an object holding '" + key + "'");
    auto it = fields.find(key);
    if (it == fields.end()) throw std::runtime_error("missing key '" + key + "'");
    return it->second;
  }
  const std::string& str() const {
    if (kind != Kind::String) throw std::runtime_error("expected a string");
    return text;
  }
  double num() const {
    if (kind != Kind::Number) throw std::runtime_error("expected a number");
    return number;
  }
  const std::vector<Json>& arr() const {
    if (kind != Kind::Array) throw std::runtime_error("expected an array");
    return items;
  }
};

class JsonParser {
 public:
  explicit JsonParser(const std::string& src) : s_(src) {}

  Json parse() {
    Json v = value(0);
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;

  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("invalid JSON at byte " + std::to_string(i_) + ": " + what);
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    return s_[i_];
  }
  void expect(const char* word) {
    for (const char* c = word; *c; ++c, ++i_)
      if (i_ >= s_.size() || s_[i_] != *c) fail(std::string("expected ") + word);
  }

  Json value(int depth) {
    if (depth > 64) fail("nested too deep");
    Json v;
    char c = peek();
    if (c == '{') {
      v.kind = Json::Kind::Object;
      ++i_;
      if (peek() == '}') { ++i_; return v; }
      for (;;) {
        if (peek() != '"') fail("expected a key");
        std::string key = string();
        if (peek() != ':') fail("expected ':'");
        ++i_;
        if (v.fields.count(key)) fail("duplicate key '" + key + "'");
        v.fields.emplace(key, value(depth + 1));
        char d = peek();
        ++i_;
        if (d == '}') return v;
        if (d != ',') fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = Json::Kind::Array;
      ++i_;
      if (peek() == ']') { ++i_; return v; }
      for (;;) {
        v.items.push_back(value(depth + 1));
        char d = peek();
        ++i_;
        if (d == ']') return v;
        if (d != ',') fail("expected ',' or ']'");
      }
    }
    if (c == '"') { v.kind = Json::Kind::String; v.text = string(); return v; }
    if (c == 't') { expect("true"); v.kind = Json::Kind::Bool; v.boolean = true; return v; }
    if (c == 'f') { expect("false"); v.kind = Json::Kind::Bool; return v; }
    if (c == 'n') { expect("null"); return v; }
    if (c == '-' || (c >= '0' && c <= '9')) { v.kind = Json::Kind::Number; v.number = number(); return v; }
    fail("unexpected character");
  }

  double number() {
    size_t start = i_;
    if (s_[i_] == '-') ++i_;
    auto digits = [&] {
      size_t d = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == d) fail("bad number");
    };
    digits();
    if (i_ < s_.size() && s_[i_] == '.') { ++i_; digits(); }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return std::stod(s_.substr(start, i_ - start));
  }

  static void utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) { out += char(cp); return; }
    if (cp < 0x800) { out += char(0xC0 | (cp >> 6)); }
    else if (cp < 0x10000) { out += char(0xE0 | (cp >> 12)); out += char(0x80 | ((cp >> 6) & 0x3F)); }
    else { out += char(0xF0 | (cp >> 18)); out += char(0x80 | ((cp >> 12) & 0x3F)); out += char(0x80 | ((cp >> 6) & 0x3F)); }
    out += char(0x80 | (cp & 0x3F));
  }
  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k, ++i_) {
      char h = s_[i_];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= uint32_t(h - '0');
      else if (h >= 'a' && h <= 'f') v |= uint32_t(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= uint32_t(h - 'A' + 10);
      else fail("bad \\u escape");
    }
    return v;
  }

  std::string string() {
    ++i_;  // opening quote
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[i_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("control character in string");
      if (c != '\\') { out += char(c); continue; }
      if (i_ >= s_.size()) fail("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("lone surrogate");
            i_ += 2;
            uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("lone surrogate");
          }
          utf8(out, cp);
          break;
        }
        default: fail("bad escape");
      }
    }
  }
};

inline Json parse_json(const std::string& text) { return JsonParser(text).parse(); }

// A string as a JSON literal (for --json output).
inline std::string json_quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else out += char(c);
  }
  return out + "\"";
}

}  // namespace fedmvp
