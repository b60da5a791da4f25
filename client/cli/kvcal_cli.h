// Pieces of the `kvcal` command shared between its source files.
#ifndef KVCAL_CLIENT_CLI_KVCAL_CLI_H_
#define KVCAL_CLIENT_CLI_KVCAL_CLI_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace kvcal {

// What a subcommand produced: JSON for --json, and its exit status (inspect
// exits 1 when a check fails even though it ran).
struct CommandResult {
  nlohmann::ordered_json json;
  int exit_code = 0;
};

struct DemoArgs {
  std::string dir;     // empty: a new directory under /tmp
  std::string worker;  // empty: FindWorkerBinary()
  std::string backend = "auto";
  bool json = false;
};

absl::StatusOr<CommandResult> RunDemo(const DemoArgs& args);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CLI_KVCAL_CLI_H_
