// Files written so that a crash leaves either the old contents or the new,
// and errors that name the file: the worker's state store and the client's
// checkpoint writer both use these.
//
//   KVCAL_RETURN_IF_ERROR(ReplaceFileDurably(path, bytes));  // all or nothing
#ifndef KVCAL_UTIL_FILE_IO_H_
#define KVCAL_UTIL_FILE_IO_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcal {

// "<what> <path>: <strerror(errno)>", NotFound for ENOENT, else `code`.
absl::Status ErrnoError(absl::string_view what, absl::string_view path,
                        absl::StatusCode code = absl::StatusCode::kInternal);

// Closes a file descriptor on scope exit.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor();
  int get() const { return fd_; }
  // Closes now and reports a failure (close can report write-back errors).
  bool Close();

 private:
  int fd_;
};

// Writes all `size` bytes (retrying short writes and EINTR).
absl::Status WriteAll(int fd, const void* data, size_t size,
                      absl::string_view path,
                      absl::StatusCode code = absl::StatusCode::kInternal);
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);
// Creates or truncates `path`, writes `contents` and fsyncs it.
[[nodiscard]] absl::Status WriteFileSynced(
    const std::string& path, absl::string_view contents,
    absl::StatusCode code = absl::StatusCode::kInternal);
// fsyncs a directory, so renames and creations in it survive a crash.
[[nodiscard]] absl::Status SyncDirectory(
    const std::string& path,
    absl::StatusCode code = absl::StatusCode::kInternal);
// Replaces `path` with `contents` atomically and durably: writes
// `path`.tmp, fsyncs it, renames it over `path` and fsyncs the directory.
// On failure the temporary file is removed and `path` is unchanged.
[[nodiscard]] absl::Status ReplaceFileDurably(
    const std::string& path, absl::string_view contents,
    absl::StatusCode code = absl::StatusCode::kInternal);

}  // namespace kvcal

#endif  // KVCAL_UTIL_FILE_IO_H_
