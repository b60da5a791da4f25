#include "client/rpc/local_worker.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace kvcal {
namespace {

namespace fs = std::filesystem;

std::string ReadTail(const std::string& path, size_t max_bytes = 2000) {
  std::ifstream in(path, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(in)),
                std::istreambuf_iterator<char>());
  if (s.size() > max_bytes) s = s.substr(s.size() - max_bytes);
  return s;
}

}  // namespace

absl::StatusOr<std::string> FindWorkerBinary() {
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (const fs::path& candidate :
         {self.parent_path() / ".." / "service" / "kvcal-worker",
          self.parent_path() / "kvcal-worker"}) {
      if (::access(candidate.c_str(), X_OK) == 0) {
        return fs::weakly_canonical(candidate, ec).string();
      }
    }
  }
  if (const char* path = std::getenv("PATH")) {
    for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
      const fs::path candidate = fs::path(std::string(dir)) / "kvcal-worker";
      if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    }
  }
  return absl::NotFoundError(
      "kvcal-worker not found next to kvcal (../service/kvcal-worker) nor on "
      "PATH; build it (./run build) or pass --worker PATH");
}

absl::StatusOr<std::unique_ptr<LocalWorker>> LocalWorker::Start(
    Options options) {
  std::unique_ptr<LocalWorker> worker(new LocalWorker());
  char dir_template[] = "/tmp/kvcal-worker-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp: ", std::strerror(errno)));
  }
  worker->dir_ = dir_template;
  worker->binary_ = options.binary;
  const std::string port_file = worker->dir_ + "/port";
  worker->log_path_ = worker->dir_ + "/worker.log";
  std::vector<std::string> args = {
      options.binary,  "--listen",    options.listen, "--backend",
      options.backend, "--port-file", port_file};
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  // posix_spawn, not fork: this process may already run gRPC threads.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO,
                                   worker->log_path_.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  const int rc = ::posix_spawn(&worker->pid_, options.binary.c_str(), &actions,
                               nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    worker->pid_ = -1;
    return absl::InternalError(
        absl::StrCat("cannot start ", options.binary, ": ", std::strerror(rc)));
  }
  const absl::Time deadline = absl::Now() + options.startup_timeout;
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) {
      worker->port_ = port;
      return worker;
    }
    int status = 0;
    if (::waitpid(worker->pid_, &status, WNOHANG) == worker->pid_) {
      worker->pid_ = -1;
      return absl::UnavailableError(
          absl::StrCat("kvcal-worker exited during start-up: ",
                       ReadTail(worker->log_path_)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("kvcal-worker did not report its port within ",
                   absl::FormatDuration(options.startup_timeout), ": ",
                   ReadTail(worker->log_path_)));
}

LocalWorker::~LocalWorker() {
  Kill();
  std::error_code ignored;
  if (!dir_.empty()) fs::remove_all(dir_, ignored);
}

std::string LocalWorker::address() const {
  return absl::StrCat("127.0.0.1:", port_);
}

absl::Status LocalWorker::Stop(absl::Duration grace) {
  if (pid_ <= 0) return absl::OkStatus();
  ::kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  while (true) {
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) break;
    if (absl::Now() > deadline) {
      Kill();
      return absl::DeadlineExceededError(
          absl::StrCat("kvcal-worker did not stop within ",
                       absl::FormatDuration(grace), " of SIGTERM; killed"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  pid_ = -1;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(
      "kvcal-worker ended with ",
      WIFEXITED(status) ? absl::StrCat("exit status ", WEXITSTATUS(status))
                        : absl::StrCat("signal ", WTERMSIG(status)),
      ": ", ReadTail(log_path_)));
}

void LocalWorker::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

}  // namespace kvcal
