// One writer per checkpoint: an advisory lock (flock(2)) on
// CHECKPOINT/.kvcal-patch/kvcal.lock, held by everything that writes a
// checkpoint (`kvcal patch`, `kvcal calibrate`, `kvcal demo`) from its first
// read of config.json to its last rename.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::CheckpointLock lock,
//       kvcal::CheckpointLock::Acquire("model", {.timeout =
//       absl::Seconds(30)}));
//   ... read, stage, commit ...   // released when `lock` goes away
//
// The holder writes who it is into the lock file (one JSON line: pid, host,
// command, start time); a refused writer names it. The kernel drops the lock
// when its holder dies, so a stale lock (the holder gone) is taken over at
// once, and its interrupted patch is then completed or discarded by the
// patcher's journal rules; a live holder's staging area is never touched.
// A clean release removes the lock file and, when nothing else is in it,
// the .kvcal-patch directory.
//
// The protocol (the same for any program that writes a checkpoint):
//   1. mkdir CHECKPOINT/.kvcal-patch (it may exist);
//   2. open .kvcal-patch/kvcal.lock with O_CREAT, no symbolic links;
//   3. flock(LOCK_EX | LOCK_NB); held by another: wait (poll) or refuse;
//   4. once locked, the path must still name the locked inode (a releasing
//      holder unlinks it): if not, close and start again;
//   5. truncate, write the holder line; work; then unlink the lock file,
//      rmdir .kvcal-patch (fails harmlessly when not empty), close.
// A reader that must not see a checkpoint change under it (`kvcal patch
// --out` copies one) takes LOCK_SH the same way and writes no line; several
// readers share the lock, a writer waits for all of them. Only a holder of
// LOCK_EX unlinks the file. `kvcal inspect` probes with LOCK_SH | LOCK_NB
// and never waits.
#ifndef KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_LOCK_H_
#define KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_LOCK_H_

#include <functional>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvcal {

inline constexpr char kCheckpointLockName[] = "kvcal.lock";

// Who holds (or last held) a checkpoint's lock, from the lock file's line.
struct LockHolder {
  bool known = false;  // the line parsed
  long long pid = 0;
  std::string host;
  std::string command;
  std::string started;  // UTC, 2026-12-05T10:11:12Z
  // What the file held when it did not parse (cleaned up, shortened).
  std::string raw;
  // "pid 123 on host h (`kvcal patch ...`), since 2026-...Z".
  std::string Describe() const;
  // True when the holder is a process of this host that no longer exists.
  bool GoneFromThisHost() const;
};

struct CheckpointLockOptions {
  // How long to wait for a lock another process holds; zero: refuse at once.
  absl::Duration timeout = absl::ZeroDuration();
  // Shared (LOCK_SH): for readers that only copy the checkpoint. Without a
  // writable checkpoint directory a shared lock is still taken when the
  // lock file exists, and skipped (held() false) when it does not.
  bool shared = false;
  // Called once if the lock is held by another process and we wait, with
  // the holder's description.
  std::function<void(const std::string& holder)> on_wait;
};

class CheckpointLock {
 public:
  // FailedPrecondition naming the holder when the lock stays held past the
  // timeout (and saying how to wait for it); errors naming the path when
  // .kvcal-patch or the lock file cannot be made (not a directory, a
  // symbolic link, a read-only checkpoint).
  static absl::StatusOr<CheckpointLock> Acquire(
      const std::string& checkpoint_dir, const CheckpointLockOptions& options);

  CheckpointLock() = default;
  CheckpointLock(CheckpointLock&& other) noexcept;
  CheckpointLock& operator=(CheckpointLock&& other) noexcept;
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;
  ~CheckpointLock() { Release(); }

  // Unlinks the lock file (exclusive holders, and the last shared one),
  // removes .kvcal-patch when empty, drops the lock. Idempotent.
  void Release();

  bool held() const { return fd_ >= 0; }
  bool exclusive() const { return held() && !shared_; }
  const std::string& checkpoint_dir() const { return dir_; }
  // Set when an exclusive lock was taken over from a holder that had died
  // without releasing it (its line), else empty.
  const std::string& stale_holder() const { return stale_holder_; }

 private:
  std::string dir_;
  std::string lock_path_;
  int fd_ = -1;
  bool shared_ = false;
  std::string stale_holder_;
};

// CHECKPOINT/.kvcal-patch, and its lock file.
std::string PatchStagingPath(const std::string& checkpoint_dir);
std::string CheckpointLockPath(const std::string& checkpoint_dir);

// What a reader says about the lock without waiting (a LOCK_SH | LOCK_NB
// probe): nullopt when no writer holds it; else the holder, described.
// Errors only for a .kvcal-patch that is not a directory or a lock file
// that cannot be opened.
absl::StatusOr<std::optional<std::string>> PatchInProgress(
    const std::string& checkpoint_dir);

// The holder line a lock file holds, parsed (or not: known false).
LockHolder ParseLockHolder(const std::string& contents);

}  // namespace kvcal

#endif  // KVCAL_CLIENT_CHECKPOINT_CHECKPOINT_LOCK_H_
