// kvcal_fp8_tool: runs kvcal's CPU FP8 emulation on inputs a test wrote, so
// tests/python/test_fp8_emulation.py can compare it with PyTorch.
//
//   kvcal_fp8_tool cast IN OUT
//     IN: float32 values (little-endian); OUT: one e4m3fn byte per value
//     (Fp8E4m3fnFromFloat).
//   kvcal_fp8_tool fake_quantize IN OUT
//     IN: f32 scale, then float32 values; OUT: float32 fake-quantized values.
//   kvcal_fp8_tool attention IN OUT
//     IN: u32 tokens, heads, kv_heads, head_dim, quantize_q; then float32 q
//     [tokens, heads, dim], k, v [tokens, kv_heads, dim], q scales [heads],
//     k and v scales [kv_heads]. OUT: JSON with per-head error_sq,
//     reference_sq, relative_error and per-role values/saturated/subnormal.
//   kvcal_fp8_tool nvfp4 IN OUT
//     IN: f32 checkpoint scale, u32 variant (0 nvfp4, 1 nvfp4_4over6), then
//     float32 values (whole blocks of 16); OUT: float32 values as the NVFP4
//     cache reads them back (kernels/nvfp4.h, Nvfp4FakeQuantize).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kernels/fp8_attention.h"
#include "kernels/fp8_math.h"
#include "kernels/nvfp4.h"

namespace {

std::string ReadFile(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

template <typename T>
bool Take(const std::string& data, size_t& at, size_t n, std::vector<T>* out) {
  if (data.size() < at + n * sizeof(T)) return false;
  out->resize(n);
  std::memcpy(out->data(), data.data() + at, n * sizeof(T));
  at += n * sizeof(T);
  return true;
}

int Fail(const std::string& why) {
  std::fprintf(stderr, "kvcal_fp8_tool: %s\n", why.c_str());
  return 2;
}

int Cast(const std::string& data, const char* out_path) {
  const size_t n = data.size() / 4;
  std::vector<float> x;
  size_t at = 0;
  if (!Take(data, at, n, &x)) return Fail("short input");
  std::vector<uint8_t> bits(n);
  for (size_t i = 0; i < n; ++i) bits[i] = kvcal::Fp8E4m3fnFromFloat(x[i]);
  std::ofstream(out_path, std::ios::binary)
      .write(reinterpret_cast<const char*>(bits.data()), bits.size());
  return 0;
}

int FakeQuantize(const std::string& data, const char* out_path) {
  std::vector<float> scale, x;
  size_t at = 0;
  if (!Take(data, at, 1, &scale)) return Fail("short input");
  if (!Take(data, at, (data.size() - at) / 4, &x)) return Fail("short input");
  for (float& v : x) v = kvcal::Fp8E4m3fnFakeQuantize(v, scale[0]);
  std::ofstream(out_path, std::ios::binary)
      .write(reinterpret_cast<const char*>(x.data()), x.size() * 4);
  return 0;
}

int Attention(const std::string& data, const char* out_path) {
  std::vector<uint32_t> header;
  size_t at = 0;
  if (!Take(data, at, 5, &header)) return Fail("short header");
  const uint32_t tokens = header[0], heads = header[1], kv = header[2],
                 dim = header[3];
  std::vector<float> q, k, v;
  kvcal::HeadScales scales;
  if (!Take(data, at, size_t{tokens} * heads * dim, &q) ||
      !Take(data, at, size_t{tokens} * kv * dim, &k) ||
      !Take(data, at, size_t{tokens} * kv * dim, &v) ||
      !Take(data, at, heads, &scales.q) || !Take(data, at, kv, &scales.k) ||
      !Take(data, at, kv, &scales.v)) {
    return Fail("short input");
  }
  kvcal::AttentionInputs in{tokens, heads, kv, dim, q, k, v};
  kvcal::Fp8AttentionOptions options;
  options.quantize_q = header[4] != 0;
  kvcal::Fp8AttentionErrorSums sums(heads, kv);
  if (absl::Status s =
          kvcal::AccumulateFp8AttentionError(in, scales, options, &sums);
      !s.ok()) {
    return Fail(std::string(s.message()));
  }
  FILE* out = std::fopen(out_path, "w");
  if (out == nullptr) return Fail("cannot write output");
  auto doubles = [&](const char* name, const std::vector<double>& values) {
    std::fprintf(out, "\"%s\": [", name);
    for (size_t i = 0; i < values.size(); ++i)
      std::fprintf(out, "%s%.17g", i ? ", " : "", values[i]);
    std::fprintf(out, "], ");
  };
  auto counts = [&](const char* name, const std::vector<uint64_t>& values) {
    std::fprintf(out, "\"%s\": [", name);
    for (size_t i = 0; i < values.size(); ++i)
      std::fprintf(out, "%s%llu", i ? ", " : "",
                   static_cast<unsigned long long>(values[i]));
    std::fprintf(out, "]");
  };
  std::fprintf(out, "{");
  doubles("error_sq", sums.error_sq);
  doubles("reference_sq", sums.reference_sq);
  std::vector<double> relative(heads);
  for (uint32_t h = 0; h < heads; ++h) relative[h] = sums.RelativeError(h);
  doubles("relative_error", relative);
  const char* names[3] = {"q", "k", "v"};
  for (int r = 0; r < 3; ++r) {
    std::fprintf(out, "\"%s\": {", names[r]);
    counts("values", sums.roles[r].values);
    std::fprintf(out, ", ");
    counts("saturated", sums.roles[r].saturated);
    std::fprintf(out, ", ");
    counts("subnormal", sums.roles[r].subnormal);
    std::fprintf(out, "}%s", r < 2 ? ", " : "");
  }
  std::fprintf(out, "}\n");
  std::fclose(out);
  return 0;
}

}  // namespace

int Nvfp4(const std::string& data, const char* out_path) {
  std::vector<float> scale;
  std::vector<uint32_t> variant;
  std::vector<float> x;
  size_t at = 0;
  if (!Take(data, at, 1, &scale) || !Take(data, at, 1, &variant)) {
    return Fail("short input");
  }
  if (!Take(data, at, (data.size() - at) / 4, &x)) return Fail("short input");
  std::vector<float> out(x.size());
  const absl::Status status = kvcal::Nvfp4FakeQuantize(
      x, scale[0],
      variant[0] == 1 ? kvcal::Nvfp4Variant::kFourOverSix
                      : kvcal::Nvfp4Variant::kDefault,
      absl::MakeSpan(out));
  if (!status.ok()) return Fail(std::string(status.message()));
  std::ofstream(out_path, std::ios::binary)
      .write(reinterpret_cast<const char*>(out.data()), out.size() * 4);
  return 0;
}

int main(int argc, char** argv) {
  if (argc != 4) {
    return Fail(
        "usage: kvcal_fp8_tool cast|fake_quantize|attention|nvfp4 IN OUT");
  }
  const std::string mode = argv[1];
  const std::string data = ReadFile(argv[2]);
  if (mode == "cast") return Cast(data, argv[3]);
  if (mode == "fake_quantize") return FakeQuantize(data, argv[3]);
  if (mode == "attention") return Attention(data, argv[3]);
  if (mode == "nvfp4") return Nvfp4(data, argv[3]);
  return Fail("unknown mode " + mode);
}
