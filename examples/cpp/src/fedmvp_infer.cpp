// fedmvp_infer: runs a fedmvp edge bundle's TorchScript module (model.torchscript.pt) from C++ with the
// libtorch inside the pip torch wheel. Usage and build: docs/howto/cpp-libtorch.md.
//
//   fedmvp_infer <bundle_dir> <image>... [--top K] [--json] [--threads T] [--lora FILE]
//   fedmvp_infer <bundle_dir> --check-images [--top K] [--json]
//   fedmvp_infer <bundle_dir> --bench N [--batch B] [--threads T]
//
// Every bundle file it reads is checked against the manifest's sha256 first; bad input is one line on
// stderr and exit 2; an unreadable image is one line and exit 1 after the others ran.
#include <ATen/Parallel.h>
#include <torch/script.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "json.hpp"
#include "preprocess.hpp"
#include "safetensors.hpp"
#include "sha256.hpp"

namespace fedmvp {
namespace {

struct Options {
  std::string bundle;
  std::vector<std::string> images;
  int top = 5;
  bool json = false;
  bool check_images = false;
  int bench = 0;
  int batch = 8;
  int threads = 0;
  std::string lora;      // another LoRA file (a personalised or a round's global one), else the bundle's
  std::string dump_rgb;  // test hook: write the uint8 pixels after resize and crop (raw) and stop
};

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int positive(const std::string& flag, const std::string& v) {
  try {
    size_t used = 0;
    int n = std::stoi(v, &used);
    if (used == v.size() && n > 0) return n;
  } catch (const std::exception&) {
  }
  throw UsageError(flag + " needs a positive integer, got '" + v + "'");
}

Options parse_args(int argc, char** argv) {
  Options o;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto next = [&]() -> const std::string& {
      if (i + 1 >= args.size()) throw UsageError(a + " needs a value");
      return args[++i];
    };
    if (a == "--top") o.top = positive(a, next());
    else if (a == "--json") o.json = true;
    else if (a == "--check-images") o.check_images = true;
    else if (a == "--bench") o.bench = positive(a, next());
    else if (a == "--batch") o.batch = positive(a, next());
    else if (a == "--threads") o.threads = positive(a, next());
    else if (a == "--dump-rgb") o.dump_rgb = next();
    else if (a == "--lora") o.lora = next();
    else if (a == "-h" || a == "--help") throw UsageError("");
    else if (a.rfind("--", 0) == 0) throw UsageError("unknown option " + a);
    else if (o.bundle.empty()) o.bundle = a;
    else o.images.push_back(a);
  }
  if (o.bundle.empty()) throw UsageError("no bundle folder given");
  if (o.images.empty() && !o.check_images && o.bench == 0) throw UsageError("no images given (or --check-images, --bench N)");
  return o;
}

// A bundle file named by role, checked against the manifest's sha256 before anything reads it.
std::string verified_file(const std::string& bundle, const Json& manifest, const std::string& name) {
  if (name.find('/') != std::string::npos || name.empty() || name[0] == '.')
    throw std::runtime_error("manifest.json: file name '" + name + "' is not a plain file name");
  const std::string path = bundle + "/" + name;
  const Json& entry = manifest.at("files").at(name);
  const std::string want = entry.at("sha256").str();
  const std::string got = sha256_file(path);
  if (got != want)
    throw std::runtime_error(path + ": sha256 does not match the manifest (file changed or damaged); refused");
  return path;
}

struct Bundle {
  Json manifest;
  PreprocessSpec spec;
  std::vector<std::string> classes;
  torch::jit::Module module;
  std::vector<torch::Tensor> lora;  // in manifest["torchscript"]["lora_inputs"] order
};

Bundle open_bundle(const std::string& dir, const std::string& other_lora) {
  Bundle b;
  const std::string manifest_path = dir + "/manifest.json";
  try {
    b.manifest = parse_json(read_file_bytes(manifest_path, 64u << 20));
    if (b.manifest.at("format").str() != "fedmvp-edge-bundle") throw std::runtime_error("not a fedmvp edge bundle");
    b.spec = PreprocessSpec::from_manifest(b.manifest.at("preprocess"));
    for (const auto& n : b.manifest.at("classes").at("names").arr()) b.classes.push_back(n.str());
  } catch (const std::exception& e) {
    throw std::runtime_error(manifest_path + ": " + e.what());
  }
  if (!b.manifest.has("torchscript"))
    throw std::runtime_error(dir + ": the bundle carries no TorchScript module (re-export it with fedmvp-export --format torchscript)");
  const Json& ts = b.manifest.at("torchscript");
  const std::string model = verified_file(dir, b.manifest, ts.at("file").str());
  // The bundle's LoRA is pinned by the manifest's sha256; another one (--lora) only by the names and
  // shapes the manifest lists, as edge-client checks a device's LoRA.
  const std::string lora_path = other_lora.empty()
      ? verified_file(dir, b.manifest, b.manifest.at("files_by_role").at("lora").str()) : other_lora;
  auto tensors = read_safetensors(lora_path);
  const Json& shapes = b.manifest.at("lora").at("tensors");
  for (const auto& name : ts.at("lora_inputs").arr()) {
    auto it = tensors.find(name.str());
    if (it == tensors.end()) throw std::runtime_error(lora_path + ": no tensor '" + name.str() + "'");
    if (it->second.dtype != "F32") throw std::runtime_error(lora_path + ": tensor '" + name.str() + "' is not F32");
    std::vector<int64_t> want;
    for (const auto& d : shapes.at(name.str()).arr()) want.push_back(int64_t(d.num()));
    if (want != it->second.shape)
      throw std::runtime_error(lora_path + ": tensor '" + name.str() + "' has another shape than the manifest's");
    auto t = torch::empty(it->second.shape, torch::kFloat32);
    std::memcpy(t.data_ptr<float>(), it->second.bytes.data(), it->second.bytes.size());
    b.lora.push_back(t);
  }
  try {
    b.module = torch::jit::load(model, torch::kCPU);
  } catch (const c10::Error& e) {
    throw std::runtime_error(model + ": torch::jit::load failed (" + std::string(e.what_without_backtrace()) + ")");
  }
  b.module.eval();
  return b;
}

// pixel_values [N, 3, S, S] -> probabilities [N, classes].
torch::Tensor run(Bundle& b, const torch::Tensor& pixels) {
  std::vector<torch::jit::IValue> inputs{pixels};
  for (const auto& t : b.lora) inputs.emplace_back(t);
  auto out = b.module.forward(inputs).toTuple();
  return out->elements().at(1).toTensor().contiguous();
}

// uint8 [N, S, S, 3] images (already resized and cropped) -> normalised [N, 3, S, S].
torch::Tensor normalised_batch(const std::vector<const unsigned char*>& images, const PreprocessSpec& spec) {
  const int64_t S = spec.image_size;
  auto x = torch::empty({int64_t(images.size()), 3, S, S}, torch::kFloat32);
  float* dst = x.data_ptr<float>();
  for (size_t i = 0; i < images.size(); ++i) normalise_into(images[i], spec, dst + i * 3 * S * S);
  return x;
}

void print_result(const Options& o, const Bundle& b, const std::string& name, const float* probs) {
  const int n = int(b.classes.size());
  std::vector<int> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const int k = std::min(o.top, n);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int c) { return probs[a] > probs[c] || (probs[a] == probs[c] && a < c); });
  std::string line;
  char buf[64];
  if (o.json) {
    line = "{\"image\": " + json_quote(name) + ", \"ok\": true, \"runtime\": \"libtorch\", \"top_k\": [";
    for (int i = 0; i < k; ++i) {
      std::snprintf(buf, sizeof buf, "%.6g", probs[order[size_t(i)]]);
      line += std::string(i ? ", " : "") + "{\"class\": " + json_quote(b.classes[size_t(order[size_t(i)])]) +
              ", \"index\": " + std::to_string(order[size_t(i)]) + ", \"prob\": " + buf + "}";
    }
    line += "]}";
  } else {
    line = name + ":";
    for (int i = 0; i < k; ++i) {
      std::snprintf(buf, sizeof buf, " (%.3f)", probs[order[size_t(i)]]);
      line += std::string(i ? "," : "") + " " + b.classes[size_t(order[size_t(i)])] + buf;
    }
  }
  std::cout << line << "\n";
}

// The bundle's check images: uint8 [N, S, S, 3], already resized and cropped (no decoding differences).
std::vector<unsigned char> check_images(const std::string& dir, const Bundle& b, int64_t& count) {
  const std::string name = b.manifest.at("files_by_role").at("check").str();
  const std::string path = verified_file(dir, b.manifest, name);
  auto tensors = read_safetensors(path);
  auto it = tensors.find("images");
  const int64_t S = b.spec.image_size;
  if (it == tensors.end() || it->second.dtype != "U8" || it->second.shape.size() != 4 || it->second.shape[1] != S ||
      it->second.shape[2] != S || it->second.shape[3] != 3)
    throw std::runtime_error(path + ": expected a U8 tensor 'images' of shape [N, " + std::to_string(S) + ", " +
                             std::to_string(S) + ", 3]");
  count = it->second.shape[0];
  return std::move(it->second.bytes);
}

int bench(const Options& o, Bundle& b) {
  int64_t count = 0;
  auto pixels = check_images(o.bundle, b, count);
  if (count == 0) throw std::runtime_error("the bundle has no check images to time");
  const size_t one = size_t(b.spec.image_size) * b.spec.image_size * 3;
  std::vector<const unsigned char*> batch;
  for (int i = 0; i < o.batch; ++i) batch.push_back(&pixels[size_t(i % count) * one]);
  auto x = normalised_batch(batch, b.spec);
  for (int i = 0; i < 2; ++i) run(b, x);  // warm-up: the first calls optimise the graph
  std::vector<double> ms;
  for (int r = 0; r < o.bench; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    run(b, x);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / o.batch);
  }
  std::sort(ms.begin(), ms.end());
  std::printf("{\"bench\": {\"batch\": %d, \"runs\": %d, \"threads\": %d, \"ms_per_image_median\": %.4f, "
              "\"ms_per_image_min\": %.4f}}\n",
              o.batch, o.bench, at::get_num_threads(), ms[ms.size() / 2], ms.front());
  return 0;
}

int infer(const Options& o, Bundle& b) {
  const size_t one = size_t(b.spec.image_size) * b.spec.image_size * 3;
  std::vector<std::string> inputs;  // every input, in order: "check:<i>" or the path
  std::vector<std::string> errors;  // per input: "" or its one-line error
  size_t decoded = 0;               // inputs whose pixels are in `pixels`, in order
  std::vector<unsigned char> pixels;
  if (o.check_images) {
    int64_t count = 0;
    pixels = check_images(o.bundle, b, count);
    for (int64_t i = 0; i < count; ++i) inputs.push_back("check:" + std::to_string(i));
    errors.assign(size_t(count), "");
    decoded = size_t(count);
  }
  for (const auto& path : o.images) {
    try {
      auto crop = resize_crop(decode_image(path), b.spec);
      pixels.insert(pixels.end(), crop.begin(), crop.end());
      errors.emplace_back();
      ++decoded;
    } catch (const std::exception& e) {
      errors.emplace_back(e.what());
    }
    inputs.push_back(path);
    if (!errors.back().empty()) std::cerr << errors.back() << "\n";
  }
  if (!o.dump_rgb.empty()) {
    FILE* f = std::fopen(o.dump_rgb.c_str(), "wb");
    if (!f || std::fwrite(pixels.data(), 1, pixels.size(), f) != pixels.size()) throw std::runtime_error(o.dump_rgb + ": cannot write");
    std::fclose(f);
  } else {
    std::vector<float> probs(decoded * b.classes.size());
    for (size_t start = 0; start < decoded; start += size_t(o.batch)) {
      const size_t end = std::min(decoded, start + size_t(o.batch));
      std::vector<const unsigned char*> batch;
      for (size_t i = start; i < end; ++i) batch.push_back(&pixels[i * one]);
      auto p = run(b, normalised_batch(batch, b.spec));
      if (p.dim() != 2 || p.size(0) != int64_t(end - start) || p.size(1) != int64_t(b.classes.size()))
        throw std::runtime_error("the module's probabilities do not have one row per image and one column per class");
      std::memcpy(&probs[start * b.classes.size()], p.data_ptr<float>(), size_t(p.numel()) * sizeof(float));
    }
    size_t ok = 0;
    for (size_t i = 0; i < errors.size(); ++i) {
      if (errors[i].empty()) {
        print_result(o, b, inputs[i], &probs[ok * b.classes.size()]);
        ++ok;
      } else if (o.json) {
        std::cout << "{\"image\": " << json_quote(inputs[i]) << ", \"ok\": false, \"error\": " << json_quote(errors[i]) << "}\n";
      }
    }
  }
  int failed = 0;
  for (const auto& err : errors) failed += !err.empty();
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace fedmvp

int main(int argc, char** argv) {
  using namespace fedmvp;
  Options o;
  try {
    o = parse_args(argc, argv);
  } catch (const UsageError& e) {
    if (*e.what()) std::cerr << "fedmvp_infer: " << e.what() << "\n";
    std::cerr << "usage: fedmvp_infer <bundle_dir> <image>... [--check-images] [--top K] [--json] [--threads T] "
                 "[--lora FILE] [--bench N --batch B]\n";
    return 2;
  }
  try {
    if (o.threads > 0) at::set_num_threads(o.threads);
    c10::InferenceMode guard;
    Bundle b = open_bundle(o.bundle, o.lora);
    return o.bench > 0 ? bench(o, b) : infer(o, b);
  } catch (const c10::Error& e) {
    std::cerr << "fedmvp_infer: torch error: " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fedmvp_infer: " << e.what() << "\n";
    return 2;
  }
}
