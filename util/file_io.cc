#include "util/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

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

absl::Status WriteFileSynced(const std::string& path,
                             absl::string_view contents,
                             absl::StatusCode code) {
  FileDescriptor fd(
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoError("cannot create", path, code);
  KVCAL_RETURN_IF_ERROR(
      WriteAll(fd.get(), contents.data(), contents.size(), path, code));
  if (::fsync(fd.get()) != 0) return ErrnoError("cannot fsync", path, code);
  if (!fd.Close()) return ErrnoError("cannot close", path, code);
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& path, absl::StatusCode code) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError("cannot open directory", path, code);
  if (::fsync(fd.get()) != 0) {
    return ErrnoError("cannot fsync directory", path, code);
  }
  return absl::OkStatus();
}

absl::Status ReplaceFileDurably(const std::string& path,
                                absl::string_view contents,
                                absl::StatusCode code) {
  const std::string temp = path + ".tmp";
  absl::Status status = WriteFileSynced(temp, contents, code);
  if (status.ok() && ::rename(temp.c_str(), path.c_str()) != 0) {
    status = ErrnoError("cannot rename onto", path, code);
  }
  if (!status.ok()) {
    ::unlink(temp.c_str());
    return status;
  }
  std::string dir = std::filesystem::path(path).parent_path().string();
  return SyncDirectory(dir.empty() ? "." : dir, code);
}

}  // namespace kvcal
