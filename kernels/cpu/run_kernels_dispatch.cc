// Run-time choice of the CPU inner loops (run_kernels.h).
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/run_kernels.h"

namespace kvcal::cpu {

absl::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

absl::StatusOr<CpuIsa> ParseCpuIsa(absl::string_view text) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (text == CpuIsaName(isa)) return isa;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown CPU instruction set '", text, "': use scalar, avx2 or avx512"));
}

CpuIsa SupportedCpuIsa() {
  if (Avx512Loops(DType::kBf16).rows != nullptr) return CpuIsa::kAvx512;
  if (Avx2Loops(DType::kBf16).rows != nullptr) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

CpuIsa ActiveCpuIsa() {
  static const CpuIsa active = [] {
    const CpuIsa supported = SupportedCpuIsa();
    const char* env = std::getenv("KVCAL_CPU_ISA");
    if (env == nullptr || *env == '\0') return supported;
    absl::StatusOr<CpuIsa> wanted = ParseCpuIsa(env);
    if (!wanted.ok()) {
      std::fprintf(stderr, "kvcal: KVCAL_CPU_ISA ignored: %s\n",
                   std::string(wanted.status().message()).c_str());
      return supported;
    }
    return static_cast<int>(*wanted) < static_cast<int>(supported) ? *wanted
                                                                   : supported;
  }();
  return active;
}

Loops LoopsFor(CpuIsa isa, DType dtype) {
  switch (isa) {
    case CpuIsa::kScalar:
      return ScalarLoops(dtype);
    case CpuIsa::kAvx2:
      return Avx2Loops(dtype);
    case CpuIsa::kAvx512:
      return Avx512Loops(dtype);
  }
  return {};
}

Loops BestLoops(DType dtype) {
  for (int isa = static_cast<int>(ActiveCpuIsa()); isa >= 0; --isa) {
    const Loops loops = LoopsFor(static_cast<CpuIsa>(isa), dtype);
    if (loops.rows != nullptr) return loops;
  }
  return ScalarLoops(dtype);
}

}  // namespace kvcal::cpu
