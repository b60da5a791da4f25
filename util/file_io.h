// Files written so that a crash leaves either the old contents or the new,
// and errors that name the file. WriteOutputFile is the one way kvcal writes
// a file: the worker's state store and port file, the scales file, the
// report, the patcher's staged files, the demo's checkpoint all go through it.
//
//   KVCAL_RETURN_IF_ERROR(WriteOutputFile(path, bytes));  // all or nothing
#ifndef KVCAL_UTIL_FILE_IO_H_
#define KVCAL_UTIL_FILE_IO_H_

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>

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
  // Gives up ownership: the caller closes the returned descriptor.
  int Release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

// Writes all `size` bytes (retrying short writes and EINTR).
absl::Status WriteAll(int fd, const void* data, size_t size,
                      absl::string_view path,
                      absl::StatusCode code = absl::StatusCode::kInternal);
absl::StatusOr<std::string> ReadSmallFile(const std::string& path);
// fsyncs a directory, so renames and creations in it survive a crash.
[[nodiscard]] absl::Status SyncDirectory(
    const std::string& path,
    absl::StatusCode code = absl::StatusCode::kInternal);

// Temporary files WriteOutputFile creates are named
// "<target name>.<pid>-<n>.kvcal-tmp", beside the target; one that a killed
// process left behind may be removed by anyone who finds it.
inline constexpr char kOutputTempSuffix[] = ".kvcal-tmp";

// The file that writing `path` replaces: `path` with every symbolic link
// followed (a dangling link: the file it would create). InvalidArgument for
// an empty path or one ending in '/'; FailedPrecondition for a link loop.
absl::StatusOr<std::string> ResolveOutputPath(const std::string& path);

// What WriteOutputFile checks before it creates anything, for commands that
// check their output path before long work: OK when `path` (links
// followed) does not exist in an existing directory, or is a regular file.
[[nodiscard]] absl::Status CheckOutputPath(const std::string& path);

// True when both paths exist and name the same file (links followed).
bool SameFile(const std::string& a, const std::string& b);

// A std::filesystem error as a status: Internal, "<what>: <the error>".
absl::Status FilesystemError(absl::string_view what, const std::error_code& ec);

// Renames `from` to `to` (std::filesystem::rename); Internal naming both.
absl::Status RenamePath(const std::filesystem::path& from,
                        const std::filesystem::path& to);

// Copies a regular file (replacing `to`) and fsyncs the copy, or copies a
// directory tree; `copied` is told the bytes of each regular file copied.
absl::Status CopyFileOrTreeSynced(
    const std::filesystem::path& from, const std::filesystem::path& to,
    const std::function<void(uint64_t bytes)>& copied = nullptr);

// Writes the bytes of an output file to `fd` (a new temporary file; its
// name, for messages, is `temp_path`).
using OutputFileWriter =
    std::function<absl::Status(int fd, const std::string& temp_path)>;

// The one way to write an output file. `write` fills a temporary file
// created beside the target, which is fsynced, renamed over the target, and
// the directory fsynced: a reader sees the old file or the new one, never a
// part, and a crash leaves one of the two. A symbolic link is written
// through: the link stays, the file it points to is replaced (its mode is
// kept). A target that exists and is not a regular file (a directory, a
// device, a FIFO, a socket) is refused with FailedPrecondition before
// anything is created, and a missing directory is NotFound. Any failure
// (`write`'s own, EFBIG, ENOSPC, fsync, rename) removes the temporary file
// and leaves the target as it was. Errors use `code` unless they say
// otherwise above.
[[nodiscard]] absl::Status WriteOutputFile(
    const std::string& path, const OutputFileWriter& write,
    absl::StatusCode code = absl::StatusCode::kInternal);
[[nodiscard]] absl::Status WriteOutputFile(
    const std::string& path, absl::string_view contents,
    absl::StatusCode code = absl::StatusCode::kInternal);

}  // namespace kvcal

#endif  // KVCAL_UTIL_FILE_IO_H_
