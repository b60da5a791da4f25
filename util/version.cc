#include "util/version.h"

#include "absl/strings/str_cat.h"

#include "util/version_info.h"  // generated: cmake/KvcalVersion.cmake

#ifndef KVCAL_BACKENDS
#error "KVCAL_BACKENDS is set by util/CMakeLists.txt"
#endif

namespace kvcal {

absl::string_view Version() { return KVCAL_VERSION; }
absl::string_view GitCommit() { return KVCAL_GIT_COMMIT; }
absl::string_view CompiledBackends() { return KVCAL_BACKENDS; }

std::string VersionLine(absl::string_view program) {
  return absl::StrCat(program, " ", Version(), " (commit ", GitCommit(),
                      "; backends: ", CompiledBackends(), ")");
}

}  // namespace kvcal
