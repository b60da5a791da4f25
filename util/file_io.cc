#include "util/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "util/status_macros.h"

namespace kvcal {

absl::Status ErrnoError(absl::string_view what, absl::string_view path,
                        absl::StatusCode code) {
  const int err = errno;
  return absl::Status(err == ENOENT ? absl::StatusCode::kNotFound : code,
                      absl::StrCat(what, " ", path, ": ", std::strerror(err)));
}

FileDescriptor::~FileDescriptor() {
  if (fd_ >= 0) ::close(fd_);
}

bool FileDescriptor::Close() {
  const int fd = fd_;
  fd_ = -1;
  return ::close(fd) == 0;
}

absl::Status WriteAll(int fd, const void* data, size_t size,
                      absl::string_view path, absl::StatusCode code) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("cannot write", path, code);
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError("cannot open", path);
  std::string contents;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("cannot read", path);
    }
    if (n == 0) break;
    contents.append(buffer, static_cast<size_t>(n));
  }
  return contents;
}

absl::Status SyncDirectory(const std::string& path, absl::StatusCode code) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError("cannot open directory", path, code);
  if (::fsync(fd.get()) != 0) {
    return ErrnoError("cannot fsync directory", path, code);
  }
  return absl::OkStatus();
}

namespace {

// The directory part of a path whose last component is a file name.
std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string BaseName(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

const char* FileKind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

std::atomic<uint64_t> temp_files_created{0};

}  // namespace

absl::StatusOr<std::string> ResolveOutputPath(const std::string& path) {
  if (path.empty())
    return absl::InvalidArgumentError("the output path is empty");
  std::string current = path;
  // Linux's own limit on the links one lookup follows.
  for (int hops = 0; hops <= 40; ++hops) {
    if (current.back() == '/') {
      return absl::InvalidArgumentError(absl::StrCat(
          "output path ", current,
          current == path ? ""
                          : absl::StrCat(" (where the link ", path, " points)"),
          " ends in '/': give a file name"));
    }
    struct stat st;
    if (::lstat(current.c_str(), &st) != 0) {
      if (errno == ENOENT) return current;  // created by the write
      return ErrnoError("cannot examine", current,
                        absl::StatusCode::kFailedPrecondition);
    }
    if (!S_ISLNK(st.st_mode)) return current;
    std::string target(4096, '\0');
    const ssize_t n = ::readlink(current.c_str(), target.data(), target.size());
    if (n < 0) {
      return ErrnoError("cannot read the symbolic link", current,
                        absl::StatusCode::kFailedPrecondition);
    }
    target.resize(static_cast<size_t>(n));
    if (target.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the symbolic link ", current, " is empty"));
    }
    const std::string dir = DirName(current);
    current = target[0] == '/' || dir == "." ? target : dir + "/" + target;
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "output path ", path, ": too many levels of symbolic links"));
}

namespace {

// The target of writing `path` (links followed), checked: absent or a
// regular file; `exists` and `st` describe it.
absl::StatusOr<std::string> CheckedTarget(const std::string& path, bool& exists,
                                          struct stat& st, std::string& via) {
  KVCAL_ASSIGN_OR_RETURN(std::string target, ResolveOutputPath(path));
  via = target == path ? ""
                       : absl::StrCat(" (the file the symbolic link ", path,
                                      " points to)");
  exists = ::stat(target.c_str(), &st) == 0;
  if (!exists && errno != ENOENT) {
    const int err = errno;  // ENOTDIR (a parent is a file), EACCES, ...
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write ", target, via, ": ", std::strerror(err)));
  }
  if (exists && !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "refusing to write ", target, via, ": it is ", FileKind(st.st_mode),
        ", and kvcal replaces only regular files; give the path of a file"));
  }
  return target;
}

}  // namespace

absl::Status CheckOutputPath(const std::string& path) {
  bool exists = false;
  struct stat st;
  std::string via;
  KVCAL_ASSIGN_OR_RETURN(const std::string target,
                         CheckedTarget(path, exists, st, via));
  if (exists) return absl::OkStatus();
  const std::string dir = DirName(target);
  struct stat dir_stat;
  if (::stat(dir.c_str(), &dir_stat) != 0 || !S_ISDIR(dir_stat.st_mode)) {
    return absl::NotFoundError(absl::StrCat(
        "cannot write ", target, via, ": directory ", dir, " does not exist"));
  }
  return absl::OkStatus();
}

bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 &&
         sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

absl::Status WriteOutputFile(const std::string& path,
                             const OutputFileWriter& write,
                             absl::StatusCode code) {
  bool exists = false;
  struct stat st;
  std::string via;
  KVCAL_ASSIGN_OR_RETURN(const std::string target,
                         CheckedTarget(path, exists, st, via));
  const std::string dir = DirName(target);
  // Beside the target (rename stays on one file system), unique per process
  // and call, short enough for NAME_MAX.
  const std::string temp =
      absl::StrCat(dir, "/", BaseName(target).substr(0, 200), ".", ::getpid(),
                   "-", temp_files_created.fetch_add(1), kOutputTempSuffix);
  FileDescriptor fd(::open(temp.c_str(),
                           O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW,
                           0644));
  if (fd.get() < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("cannot write ", target, via,
                                              ": directory ", dir,
                                              " does not exist"));
    }
    return absl::Status(
        code, absl::StrCat("cannot write ", target, via,
                           ": cannot create a temporary file in ", dir, ": ",
                           std::strerror(err)));
  }
  if (exists) {
    // Keep what the user set on the file being replaced (best effort: only
    // root may give a file away).
    (void)::fchmod(fd.get(), st.st_mode & 07777);
    if (::geteuid() == 0) (void)::fchown(fd.get(), st.st_uid, st.st_gid);
  }
  absl::Status status = write(fd.get(), temp);
  if (status.ok() && ::fsync(fd.get()) != 0) {
    status = ErrnoError("cannot fsync", temp, code);
  }
  if (status.ok() && !fd.Close()) {
    status = ErrnoError("cannot close", temp, code);
  }
  if (status.ok() && ::rename(temp.c_str(), target.c_str()) != 0) {
    status =
        ErrnoError(absl::StrCat("cannot rename ", temp, " onto"), target, code);
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return absl::Status(
        status.code(),
        absl::StrCat(status.message(), " (", target,
                     exists ? " is unchanged" : " was not created",
                     "; the temporary file was removed)"));
  }
  return SyncDirectory(dir, code);
}

absl::Status WriteOutputFile(const std::string& path,
                             absl::string_view contents,
                             absl::StatusCode code) {
  return WriteOutputFile(
      path,
      [&](int fd, const std::string& temp) {
        return WriteAll(fd, contents.data(), contents.size(), temp, code);
      },
      code);
}

absl::Status FilesystemError(absl::string_view what,
                             const std::error_code& ec) {
  return absl::InternalError(absl::StrCat(what, ": ", ec.message()));
}

absl::Status RenamePath(const std::filesystem::path& from,
                        const std::filesystem::path& to) {
  std::error_code ec;
  std::filesystem::rename(from, to, ec);
  if (ec) {
    return FilesystemError(
        absl::StrCat("cannot rename ", from.string(), " to ", to.string()), ec);
  }
  return absl::OkStatus();
}

absl::Status CopyFileOrTreeSynced(
    const std::filesystem::path& from, const std::filesystem::path& to,
    const std::function<void(uint64_t bytes)>& copied) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(from, ec)) {
    fs::copy(from, to, fs::copy_options::recursive, ec);
    if (ec)
      return FilesystemError(absl::StrCat("cannot copy ", from.string()), ec);
    return absl::OkStatus();
  }
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec)
    return FilesystemError(absl::StrCat("cannot copy ", from.string()), ec);
  const int fd = ::open(to.c_str(), O_RDONLY | O_CLOEXEC);
  const bool synced = fd >= 0 && ::fsync(fd) == 0;
  if (fd >= 0) ::close(fd);
  if (!synced) {
    return absl::InternalError(
        absl::StrCat("cannot fsync ", to.string(), ": ", std::strerror(errno)));
  }
  const uintmax_t size = fs::file_size(to, ec);
  if (copied) copied(ec ? 0 : size);
  return absl::OkStatus();
}

}  // namespace kvcal
