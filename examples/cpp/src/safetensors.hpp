// safetensors reader: 8-byte little-endian header length, a JSON header, then raw little-endian data.
// Only the dtypes a bundle uses here (F32 LoRA tensors, U8 check images); every offset is bounds-checked
// so a damaged file is one clear error, never a read past the buffer.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "json.hpp"

namespace fedmvp {

struct RawTensor {
  std::string dtype;             // "F32" or "U8"
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

inline std::string read_file_bytes(const std::string& path, size_t limit = size_t(1) << 34) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::streamoff size = in.tellg();
  if (size < 0 || static_cast<uint64_t>(size) > limit) throw std::runtime_error(path + ": file too large");
  std::string data(static_cast<size_t>(size), '\0');
  in.seekg(0);
  if (size > 0 && !in.read(data.data(), size)) throw std::runtime_error(path + ": read error");
  return data;
}

inline std::map<std::string, RawTensor> read_safetensors(const std::string& path) {
  const std::string data = read_file_bytes(path);
  auto bad = [&](const std::string& what) { return std::runtime_error(path + ": not a valid safetensors file (" + what + ")"); };
  if (data.size() < 8) throw bad("shorter than its 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<unsigned char>(data[size_t(i)]);
  if (header_len > data.size() - 8 || header_len > (100u << 20)) throw bad("header length past the end");
  Json header;
  try {
    header = parse_json(data.substr(8, header_len));
  } catch (const std::exception& e) {
    throw bad(e.what());
  }
  if (!header.is_object()) throw bad("header is not an object");
  const size_t base = 8 + header_len;
  const uint64_t body = data.size() - base;
  std::map<std::string, RawTensor> out;
  for (const auto& [name, entry] : header.fields) {
    if (name == "__metadata__") continue;
    try {
      RawTensor t;
      t.dtype = entry.at("dtype").str();
      size_t item = t.dtype == "F32" ? 4 : t.dtype == "U8" ? 1 : 0;
      if (item == 0) throw std::runtime_error("dtype " + t.dtype + " (only F32 and U8 are read)");
      uint64_t count = 1;
      for (const auto& d : entry.at("shape").arr()) {
        double v = d.num();
        if (v < 0 || v > 1e12 || v != double(int64_t(v))) throw std::runtime_error("bad shape");
        t.shape.push_back(int64_t(v));
        count *= uint64_t(v);
        if (count > (uint64_t(1) << 40)) throw std::runtime_error("shape too large");
      }
      const auto& offs = entry.at("data_offsets").arr();
      if (offs.size() != 2) throw std::runtime_error("data_offsets must hold two numbers");
      double b = offs[0].num(), e = offs[1].num();
      if (b < 0 || e < b || e > double(body) || b != double(uint64_t(b)) || e != double(uint64_t(e)))
        throw std::runtime_error("data_offsets outside the file");
      if (uint64_t(e - b) != count * item) throw std::runtime_error("data size does not match dtype and shape");
      t.bytes.assign(data.begin() + std::ptrdiff_t(base + uint64_t(b)), data.begin() + std::ptrdiff_t(base + uint64_t(e)));
      out.emplace(name, std::move(t));
    } catch (const std::exception& ex) {
      throw bad("tensor '" + name + "': " + ex.what());
    }
  }
  return out;
}

}  // namespace fedmvp
