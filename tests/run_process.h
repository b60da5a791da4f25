// Runs a program to completion and returns its exit code, stdout and stderr:
// the command-line tests of kvcal and kvcal-worker (what a user sees).
//
//   kvcal::testing::ProcessResult r =
//       kvcal::testing::RunProcess({KVCAL_CLI_PATH, "--version"});
//   EXPECT_EQ(r.exit_code, 0);
#ifndef KVCAL_TESTS_RUN_PROCESS_H_
#define KVCAL_TESTS_RUN_PROCESS_H_

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "tests/wait_until.h"

namespace kvcal::testing {

struct ProcessResult {
  // The exit status; 128 + N when killed by signal N; -1 when it did not
  // finish within the timeout (it is killed then).
  int exit_code = -1;
  std::string out;
  std::string err;
  // The lines of `err` (without their newlines).
  std::vector<std::string> ErrLines() const {
    std::vector<std::string> lines;
    size_t start = 0;
    while (start < err.size()) {
      size_t end = err.find('\n', start);
      if (end == std::string::npos) end = err.size();
      lines.push_back(err.substr(start, end - start));
      start = end + 1;
    }
    return lines;
  }
};

// `args[0]` is the program's path. `env` entries ("NAME=value") are added to
// this process's environment; "NAME=" with nothing after it removes NAME.
inline ProcessResult RunProcess(std::vector<std::string> args,
                                std::chrono::seconds timeout =
                                    std::chrono::seconds(60),
                                std::vector<std::string> env = {}) {
  static int counter = 0;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("kvcal-run-" + std::to_string(getpid()) + "-" +
       std::to_string(counter++));
  std::filesystem::create_directories(dir);
  const std::string out_path = (dir / "stdout").string();
  const std::string err_path = (dir / "stderr").string();
  const pid_t pid = fork();
  if (pid == 0) {
    if (std::freopen(out_path.c_str(), "w", stdout) == nullptr ||
        std::freopen(err_path.c_str(), "w", stderr) == nullptr) {
      _exit(126);
    }
    for (const std::string& e : env) {
      const size_t eq = e.find('=');
      if (eq + 1 == e.size()) {
        unsetenv(e.substr(0, eq).c_str());
      } else {
        setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
      }
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  ProcessResult result;
  int status = 0;
  if (WaitUntil([&] { return waitpid(pid, &status, WNOHANG) == pid; }, timeout,
                std::chrono::milliseconds(5))) {
    result.exit_code = WIFEXITED(status)     ? WEXITSTATUS(status)
                       : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                             : -1;
  } else {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  const auto slurp = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  result.out = slurp(out_path);
  result.err = slurp(err_path);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return result;
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_RUN_PROCESS_H_
