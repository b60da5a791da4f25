// What `kvcal --version` and `kvcal-worker --version` print: the version
// (the repository's VERSION file, which the Python package reads too), the
// git commit the binary was built from ("unknown" outside a git checkout)
// and the statistics backends this build has.
//
//   std::cout << kvcal::VersionLine("kvcal") << "\n";
//   // kvcal 0.1.0 (commit 792b728; backends: cpu, cuda)
#ifndef KVCAL_UTIL_VERSION_H_
#define KVCAL_UTIL_VERSION_H_

#include <string>
#include "absl/strings/string_view.h"

namespace kvcal {

absl::string_view Version();           // "0.1.0"
absl::string_view GitCommit();         // "792b728" or "unknown"
absl::string_view CompiledBackends();  // "cpu" or "cpu, cuda"
std::string VersionLine(absl::string_view program);

}  // namespace kvcal

#endif  // KVCAL_UTIL_VERSION_H_
