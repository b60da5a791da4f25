#include "client/checkpoint/checkpoint_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "util/file_io.h"
#include "util/status_macros.h"

namespace kvcal {
namespace {

using Json = nlohmann::json;

// Printable, one line, at most `max` characters.
std::string Clean(absl::string_view text, size_t max) {
  std::string out;
  for (char c : text) {
    if (out.size() >= max) {
      out += "...";
      break;
    }
    const unsigned char u = static_cast<unsigned char>(c);
    out += (u < 0x20 || u == 0x7f) ? ' ' : c;
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  out.erase(0, out.find_first_not_of(' ') == std::string::npos
                   ? out.size()
                   : out.find_first_not_of(' '));
  return out;
}

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown";
  return name;
}

// This process's command line, arguments separated by spaces.
std::string CommandLine() {
  absl::StatusOr<std::string> cmdline = ReadSmallFile("/proc/self/cmdline");
  if (!cmdline.ok() || cmdline->empty()) return "unknown";
  std::replace(cmdline->begin(), cmdline->end(), '\0', ' ');
  return Clean(*cmdline, 400);
}

std::string HolderLine() {
  return Json{{"pid", static_cast<long long>(::getpid())},
              {"host", HostName()},
              {"command", CommandLine()},
              {"started", absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::Now(),
                                           absl::UTCTimeZone())}}
             .dump() +
         "\n";
}

std::string ReadHolderLine(int fd) {
  char buffer[4096];
  const ssize_t n = ::pread(fd, buffer, sizeof(buffer), 0);
  return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : std::string();
}

bool SameInode(int fd, const std::string& path) {
  struct stat mine, now;
  return ::fstat(fd, &mine) == 0 && ::lstat(path.c_str(), &now) == 0 &&
         mine.st_dev == now.st_dev && mine.st_ino == now.st_ino;
}

bool ReadOnlyError(int err) {
  return err == EACCES || err == EROFS || err == EPERM;
}

std::string NotWritableHint(int err) {
  return ReadOnlyError(err)
             ? "; the checkpoint directory is not writable: patch a copy "
               "with --out, or get write access"
             : "";
}

}  // namespace

std::string PatchStagingPath(const std::string& checkpoint_dir) {
  return checkpoint_dir + "/.kvcal-patch";
}

std::string CheckpointLockPath(const std::string& checkpoint_dir) {
  return PatchStagingPath(checkpoint_dir) + "/" + kCheckpointLockName;
}

LockHolder ParseLockHolder(const std::string& contents) {
  LockHolder h;
  Json j = Json::parse(contents, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("pid") && j["pid"].is_number_integer()) {
    h.known = true;
    h.pid = j["pid"].get<long long>();
    auto text = [&](const char* key) {
      return j.contains(key) && j[key].is_string()
                 ? Clean(j[key].get<std::string>(), 400)
                 : std::string("?");
    };
    h.host = text("host");
    h.command = text("command");
    h.started = text("started");
  } else {
    h.raw = Clean(contents, 80);
  }
  return h;
}

std::string LockHolder::Describe() const {
  if (!known) {
    return raw.empty() ? "a process that has not written its name yet"
                       : absl::StrCat(
                             "a process unknown to kvcal (the lock "
                             "file holds \"",
                             raw, "\")");
  }
  return absl::StrCat("pid ", pid, " on ", host, " (`", command, "`), since ",
                      started);
}

bool LockHolder::GoneFromThisHost() const {
  return known && host == HostName() && pid > 0 &&
         ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

CheckpointLock::CheckpointLock(CheckpointLock&& other) noexcept
    : dir_(std::move(other.dir_)),
      lock_path_(std::move(other.lock_path_)),
      fd_(std::exchange(other.fd_, -1)),
      shared_(other.shared_),
      stale_holder_(std::move(other.stale_holder_)) {}

CheckpointLock& CheckpointLock::operator=(CheckpointLock&& other) noexcept {
  if (this != &other) {
    Release();
    dir_ = std::move(other.dir_);
    lock_path_ = std::move(other.lock_path_);
    fd_ = std::exchange(other.fd_, -1);
    shared_ = other.shared_;
    stale_holder_ = std::move(other.stale_holder_);
  }
  return *this;
}

namespace {

absl::Status CheckIsDirectory(const std::string& checkpoint_dir) {
  struct stat dir_stat;
  if (::stat(checkpoint_dir.c_str(), &dir_stat) == 0 &&
      S_ISDIR(dir_stat.st_mode)) {
    return absl::OkStatus();
  }
  const bool exists = ::access(checkpoint_dir.c_str(), F_OK) == 0;
  return absl::NotFoundError(
      exists
          ? absl::StrCat("checkpoint ", checkpoint_dir, " is not a directory")
          : absl::StrCat("checkpoint directory ", checkpoint_dir,
                         " not found"));
}

// One try at opening the lock file: kRetry when a releasing holder removed
// the staging directory or the file meanwhile, kNobodyCanWrite when a reader
// finds the checkpoint read-only (no lock needed), else the open file.
struct LockFile {
  enum Kind { kRetry, kNobodyCanWrite, kOpened } kind = kRetry;
  int fd = -1;
};

absl::StatusOr<LockFile> OpenLockFile(const std::string& checkpoint_dir,
                                      const std::string& staging,
                                      const std::string& lock_path,
                                      bool shared) {
  if (::mkdir(staging.c_str(), 0755) != 0 && errno != EEXIST) {
    const int err = errno;
    if (shared && ReadOnlyError(err))
      return LockFile{LockFile::kNobodyCanWrite};
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot lock checkpoint ", checkpoint_dir, ": cannot create ", staging,
        ": ", std::strerror(err), NotWritableHint(err)));
  }
  struct stat st;
  if (::lstat(staging.c_str(), &st) != 0) {
    if (errno == ENOENT) return LockFile{LockFile::kRetry};
    return ErrnoError("cannot examine", staging,
                      absl::StatusCode::kFailedPrecondition);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        staging,
        " exists and is not a directory; kvcal keeps its lock and staged "
        "files there: move it away and run again"));
  }
  int fd = ::open(lock_path.c_str(),
                  O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
  if (fd < 0 && shared && ReadOnlyError(errno)) {
    fd = ::open(lock_path.c_str(),
                O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0 && errno == ENOENT) return LockFile{LockFile::kNobodyCanWrite};
  }
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return LockFile{LockFile::kRetry};
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot lock checkpoint ", checkpoint_dir, ": cannot open ", lock_path,
        ": ",
        err == ELOOP ? "it is a symbolic link (kvcal's lock file is a "
                       "plain file: remove it)"
                     : std::strerror(err),
        NotWritableHint(err)));
  }
  struct stat lock_stat;
  if (::fstat(fd, &lock_stat) != 0 || !S_ISREG(lock_stat.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot lock checkpoint ", checkpoint_dir, ": ", lock_path,
        " is not a regular file (kvcal's lock file is a plain file: remove "
        "it)"));
  }
  return LockFile{LockFile::kOpened, fd};
}

// A writer that got the lock: the previous holder's line, if any, names a
// dead holder (returned in `stale`); this process's line replaces it.
absl::Status WriteHolder(int fd, const std::string& lock_path,
                         std::string* stale) {
  const std::string previous = ReadHolderLine(fd);
  if (!previous.empty()) *stale = ParseLockHolder(previous).Describe();
  const std::string line = HolderLine();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, line.data(), line.size(), 0) !=
                                     static_cast<ssize_t>(line.size())) {
    const int err = errno;
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot write the lock file ", lock_path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

// Who holds the lock `fd` could not get; `identified` when a live holder
// wrote its name (so waiting longer tells nothing new).
std::string DescribeHolder(int fd, bool shared, bool* identified) {
  *identified = false;
  if (!shared && ::flock(fd, LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd, LOCK_UN);
    return "another kvcal process reading it (`kvcal patch --out` or "
           "`kvcal calibrate --out` copying it, or `kvcal inspect`)";
  }
  const LockHolder holder = ParseLockHolder(ReadHolderLine(fd));
  *identified = holder.known && !holder.GoneFromThisHost();
  if (*identified || (!holder.known && !holder.raw.empty())) {
    return holder.Describe();
  }
  return "another process that has not written its name yet";
}

absl::Status LockedError(const std::string& checkpoint_dir,
                         const std::string& who, absl::Duration timeout,
                         const std::string& lock_path) {
  return absl::FailedPreconditionError(absl::StrCat(
      "checkpoint ", checkpoint_dir, " is locked by ", who, "; ",
      timeout > absl::ZeroDuration()
          ? absl::StrCat("waited ", absl::FormatDuration(timeout), " for it")
          : "not waiting for it (--lock-timeout 0)",
      ". Run again when it has finished, or pass --lock-timeout SECONDS to "
      "wait (lock file ",
      lock_path, ")"));
}

}  // namespace

absl::StatusOr<CheckpointLock> CheckpointLock::Acquire(
    const std::string& checkpoint_dir, const CheckpointLockOptions& options) {
  CheckpointLock lock;
  lock.dir_ = checkpoint_dir;
  lock.lock_path_ = CheckpointLockPath(checkpoint_dir);
  lock.shared_ = options.shared;
  const std::string staging = PatchStagingPath(checkpoint_dir);
  KVCAL_RETURN_IF_ERROR(CheckIsDirectory(checkpoint_dir));
  const absl::Time start = absl::Now();
  const absl::Time deadline =
      start + std::max(options.timeout, absl::ZeroDuration());
  // A holder that has not written its name yet, a dead process's name
  // (the lock is then held by someone else, about to write theirs) or a
  // reader: briefly waited for even with a zero timeout, so that a reader's
  // probe is not mistaken for a writer.
  const absl::Time grace = start + absl::Seconds(1);
  absl::Duration poll = absl::Milliseconds(5);
  bool told = false;
  while (true) {
    KVCAL_ASSIGN_OR_RETURN(
        LockFile file,
        OpenLockFile(checkpoint_dir, staging, lock.lock_path_, options.shared));
    if (file.kind == LockFile::kNobodyCanWrite) return lock;
    if (file.kind == LockFile::kRetry) continue;
    FileDescriptor guard(file.fd);
    if (::flock(file.fd, (options.shared ? LOCK_SH : LOCK_EX) | LOCK_NB) == 0) {
      // A releasing holder unlinks the file while holding it: locking an
      // unlinked file locks nothing.
      if (!SameInode(file.fd, lock.lock_path_)) continue;
      if (!options.shared) {
        KVCAL_RETURN_IF_ERROR(
            WriteHolder(file.fd, lock.lock_path_, &lock.stale_holder_));
      }
      lock.fd_ = file.fd;
      (void)guard.Release();
      return lock;
    }
    if (errno != EWOULDBLOCK) {
      return ErrnoError("cannot lock", lock.lock_path_,
                        absl::StatusCode::kFailedPrecondition);
    }
    bool identified = false;
    const std::string who =
        DescribeHolder(file.fd, options.shared, &identified);
    const absl::Time now = absl::Now();
    if (now >= deadline && (identified || now >= grace)) {
      return LockedError(checkpoint_dir, who, options.timeout, lock.lock_path_);
    }
    if (!told && options.on_wait && options.timeout > absl::ZeroDuration()) {
      options.on_wait(who);
      told = true;
    }
    guard.Close();
    absl::SleepFor(std::min(poll, std::max(absl::Milliseconds(1),
                                           std::max(deadline, grace) - now)));
    poll = std::min(poll * 2, absl::Milliseconds(20));
  }
}

void CheckpointLock::Release() {
  if (fd_ < 0) return;
  // Only a holder of LOCK_EX may unlink: a reader upgrades first (which
  // fails while another reader or a writer holds it), and leaves a file that
  // names a writer (a dead one's, for the next writer to report).
  bool remove = !shared_;
  if (shared_ && ::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    remove = ReadHolderLine(fd_).empty();
  }
  if (remove && SameInode(fd_, lock_path_)) {
    ::unlink(lock_path_.c_str());
    ::rmdir(PatchStagingPath(dir_).c_str());  // fails when not empty
  }
  ::close(fd_);
  fd_ = -1;
}

absl::StatusOr<std::optional<std::string>> PatchInProgress(
    const std::string& checkpoint_dir) {
  const std::string staging = PatchStagingPath(checkpoint_dir);
  struct stat st;
  if (::lstat(staging.c_str(), &st) != 0) {
    if (errno == ENOENT) return std::nullopt;
    return ErrnoError("cannot examine", staging,
                      absl::StatusCode::kFailedPrecondition);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        staging,
        " exists and is not a directory (kvcal keeps its lock and staged "
        "files there); move it away"));
  }
  const std::string path = CheckpointLockPath(checkpoint_dir);
  // O_NONBLOCK: a FIFO in its place must not block the reader.
  FileDescriptor fd(
      ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
  if (fd.get() < 0) {
    if (errno == ENOENT) return std::nullopt;
    return ErrnoError("cannot open", path,
                      absl::StatusCode::kFailedPrecondition);
  }
  if (::flock(fd.get(), LOCK_SH | LOCK_NB) == 0) {
    ::flock(fd.get(), LOCK_UN);
    return std::nullopt;
  }
  if (errno != EWOULDBLOCK) {
    return ErrnoError("cannot probe the lock", path,
                      absl::StatusCode::kFailedPrecondition);
  }
  return ParseLockHolder(ReadHolderLine(fd.get())).Describe();
}

}  // namespace kvcal
