// Nothing lost by accident (issue 24): one writer per checkpoint (the lock,
// unit and through the `kvcal` binary, and the concurrency stress test),
// output files written only through WriteOutputFile (`kvcal report -o`,
// `kvcal-worker --port-file`), and a patch that fails cleaning up after
// itself.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/checkpoint/checkpoint_inspect.h"
#include "client/checkpoint/checkpoint_lock.h"
#include "client/checkpoint/checkpoint_patcher.h"
#include "client/checkpoint/demo_model.h"
#include "client/checkpoint/scales_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/test_scales.h"
#include "tests/client/test_util.h"
#include "util/file_io.h"

namespace kvcal {
namespace {

namespace fs = std::filesystem;
using ::kvcal::testing::ReadFile;
using ::kvcal::testing::Snapshot;
using ::kvcal::testing::TempDir;
using ::kvcal::testing::WriteFile;
using ::testing::HasSubstr;
using Tree = std::map<std::string, std::string>;

// ---------------------------------------------------------------------------
// Child processes.

struct Result {
  int code = -1;  // exit status, or 128 + signal
  std::string out;
  std::string err;
};

struct Child {
  pid_t pid = -1;
  std::string out_path;
  std::string err_path;
};

// fork + exec (not posix_spawn: the child may get a file-size limit first).
// Only async-signal-safe calls between the two.
Child Spawn(const std::vector<std::string>& args, const std::string& log_stem,
            long file_size_limit = -1) {
  Child child{-1, log_stem + ".out", log_stem + ".err"};
  std::vector<char*> argv;
  std::vector<std::string> copy = args;
  for (std::string& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out =
        ::open(child.out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err =
        ::open(child.err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0) ::_exit(120);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    if (file_size_limit >= 0) {
      ::signal(SIGXFSZ, SIG_IGN);  // write() then fails with EFBIG
      const struct rlimit limit = {static_cast<rlim_t>(file_size_limit),
                                   static_cast<rlim_t>(file_size_limit)};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(121);
    }
    ::execv(argv[0], argv.data());
    ::_exit(122);
  }
  child.pid = pid;
  return child;
}

Result Wait(const Child& child) {
  int status = 0;
  Result r;
  if (::waitpid(child.pid, &status, 0) == child.pid) {
    r.code = WIFEXITED(status)     ? WEXITSTATUS(status)
             : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                   : -1;
  }
  r.out = ReadFile(child.out_path);
  r.err = ReadFile(child.err_path);
  return r;
}

Result RunProcess(const std::vector<std::string>& args,
                  const std::string& log_stem, long file_size_limit = -1) {
  return Wait(Spawn(args, log_stem, file_size_limit));
}

std::string ResultText(const Result& r) {
  return absl::StrCat("exit ", r.code, "\nstdout:\n", r.out, "stderr:\n",
                      r.err);
}

// Blocks until `path` holds `text` (a child's progress line): waits on the
// event, not on a time; the ctest timeout bounds a child that never writes.
void WaitForText(const std::string& path, const std::string& text) {
  while (ReadFile(path).find(text) == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(5));
  }
}

// Every entry under `dir`, hidden ones included, regular or not.
std::set<std::string> AllNames(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    names.insert(fs::relative(e.path(), dir).string());
  }
  return names;
}

// ---------------------------------------------------------------------------
// A tiny checkpoint and scales files.

DemoModelOptions TinyModel(bool sharded) {
  DemoModelOptions o;
  o.geometry = {.num_layers = 2,
                .num_attention_heads = 4,
                .num_key_value_heads = 2,
                .head_dim = 8};
  o.intermediate_size = 64;
  o.vocab_size = 256;
  o.sharded = sharded;
  return o;
}

CalibratedScales MakeScales(const DemoModelOptions& m, Granularity granularity,
                            float base) {
  return ::kvcal::testing::MakeScales(m, granularity, base, "static_minmax",
                                      "safety");
}

// (Public: the stress rounds run in a helper function.)
class SafetyTest : public ::testing::Test {
 public:
  void MakeModel(bool sharded) {
    model_ = TinyModel(sharded);
    ASSERT_TRUE(WriteDemoCheckpoint(dir_ / "pristine", model_).ok());
    Reset();
    // Different scales per writer; per tensor and per head alternate, so
    // config.json (kv_cache_scheme.strategy) and the tensors' shapes differ
    // between any two of them.
    for (int i = 0; i < 4; ++i) {
      const std::string path = dir_ / absl::StrCat("scales", i, ".safetensors");
      ASSERT_TRUE(
          WriteScalesFile(path, MakeScales(model_,
                                           i % 2 ? Granularity::kPerHead
                                                 : Granularity::kPerTensor,
                                           0.01f * (i + 1)))
              .ok());
      scales_.push_back(path);
    }
  }
  // "model" back to the pristine checkpoint.
  void Reset() {
    fs::remove_all(model());
    fs::copy(dir_ / "pristine", model(), fs::copy_options::recursive);
  }
  std::string model() const { return dir_ / "model"; }
  std::string log(const std::string& name) const { return dir_ / name; }

  // The checkpoint after patching the pristine one with scales_[i] for each
  // i of `order`, one after the other, in this process.
  Tree Sequential(const std::vector<int>& order) {
    auto it = references_.find(order);
    if (it != references_.end()) return it->second;
    const std::string ref = dir_ / "reference";
    fs::remove_all(ref);
    fs::copy(dir_ / "pristine", ref, fs::copy_options::recursive);
    for (int i : order) {
      PatchOptions options;
      options.checkpoint_dir = ref;
      options.scales_path = scales_[i];
      auto report = PatchCheckpoint(options);
      EXPECT_TRUE(report.ok()) << report.status();
    }
    EXPECT_FALSE(fs::exists(ref + "/.kvcal-patch"));
    return references_[order] = Snapshot(ref);
  }
  // Whether `tree` is what some order of the patches `which` gives.
  bool SomeOrder(std::vector<int> which, const Tree& tree) {
    std::sort(which.begin(), which.end());
    do {
      if (Sequential(which) == tree) return true;
    } while (std::next_permutation(which.begin(), which.end()));
    return false;
  }

  std::vector<std::string> PatchArgs(
      int i, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = {KVCAL_CLI_PATH, "patch",    "--checkpoint",
                                     model(),        "--scales", scales_[i]};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  }
  Result Inspect(const std::string& stem) {
    return RunProcess({KVCAL_CLI_PATH, "inspect", model()}, log(stem));
  }

  TempDir dir_;
  DemoModelOptions model_;
  std::vector<std::string> scales_;
  std::map<std::vector<int>, Tree> references_;
};

const std::string kPid = std::to_string(::getpid());

CheckpointLockOptions SharedLock() {
  CheckpointLockOptions o;
  o.shared = true;
  return o;
}

CheckpointLockOptions WithTimeout(absl::Duration timeout) {
  CheckpointLockOptions o;
  o.timeout = timeout;
  return o;
}

// ---------------------------------------------------------------------------
// The lock itself.

using CheckpointLockTest = SafetyTest;

TEST_F(CheckpointLockTest, ASecondWriterIsRefusedNamingTheHolder) {
  MakeModel(/*sharded=*/true);
  auto first = CheckpointLock::Acquire(model(), {});
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->exclusive());
  EXPECT_TRUE(first->stale_holder().empty());
  const LockHolder holder =
      ParseLockHolder(ReadFile(CheckpointLockPath(model())));
  ASSERT_TRUE(holder.known);
  EXPECT_EQ(holder.pid, ::getpid());
  EXPECT_THAT(holder.command, HasSubstr("kvcal_checkpoint_safety_test"));
  EXPECT_THAT(holder.started,
              ::testing::MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}Z"));
  // flock conflicts between two open files of one process as between two
  // processes.
  auto second = CheckpointLock::Acquire(model(), {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(second.status().message()),
              ::testing::AllOf(HasSubstr("is locked by pid " + kPid + " on "),
                               HasSubstr("kvcal_checkpoint_safety_test"),
                               HasSubstr("--lock-timeout")));
  auto probe = PatchInProgress(model());
  ASSERT_TRUE(probe.ok());
  ASSERT_TRUE(probe->has_value());
  EXPECT_THAT(**probe, HasSubstr("pid " + kPid));
  // Releasing removes the lock file and the directory.
  first->Release();
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
  EXPECT_FALSE(PatchInProgress(model())->has_value());
  EXPECT_TRUE(Snapshot(model(), "\x01") == Snapshot(dir_ / "pristine"));
}

TEST_F(CheckpointLockTest, AWaiterGetsTheLockOnceItIsReleased) {
  MakeModel(/*sharded=*/true);
  auto first = CheckpointLock::Acquire(model(), {});
  ASSERT_TRUE(first.ok());
  std::mutex mu;
  std::condition_variable cv;
  bool waiting = false;
  std::string told;
  absl::StatusOr<CheckpointLock> second = absl::UnknownError("not run");
  std::thread waiter([&] {
    second = CheckpointLock::Acquire(
        model(), {.timeout = absl::Hours(1),
                  .shared = false,
                  .on_wait = [&](const std::string& holder) {
                    std::lock_guard<std::mutex> lock(mu);
                    told = holder;
                    waiting = true;
                    cv.notify_all();
                  }});
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return waiting; });
  }
  EXPECT_THAT(told, HasSubstr("pid " + kPid));
  first->Release();
  waiter.join();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_TRUE(second->exclusive());
  EXPECT_TRUE(second->stale_holder().empty())
      << "a clean release leaves nothing stale";
  // A timeout that expires says how long it waited.
  auto third =
      CheckpointLock::Acquire(model(), WithTimeout(absl::Milliseconds(50)));
  EXPECT_THAT(std::string(third.status().message()),
              HasSubstr("waited 50ms for it"));
}

TEST_F(CheckpointLockTest, TheLockOfADeadHolderIsTakenOverAndNamed) {
  MakeModel(/*sharded=*/true);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto lock = CheckpointLock::Acquire(model(), {});
    ::_exit(lock.ok() ? 0 : 1);  // no Release: the process just ends
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ASSERT_TRUE(fs::exists(CheckpointLockPath(model())));
  EXPECT_FALSE(PatchInProgress(model())->has_value())
      << "a dead holder's lock is not a patch in progress";
  auto lock = CheckpointLock::Acquire(model(), {});
  ASSERT_TRUE(lock.ok()) << lock.status();
  EXPECT_THAT(lock->stale_holder(), HasSubstr("pid " + std::to_string(pid)));
}

TEST_F(CheckpointLockTest, GarbageInTheLockFileIsReportedNotTrusted) {
  MakeModel(/*sharded=*/true);
  fs::create_directories(model() + "/.kvcal-patch");
  WriteFile(CheckpointLockPath(model()), "\x01garbage {not json\n");
  {
    // Nobody holds it: taken over, what it held quoted.
    auto lock = CheckpointLock::Acquire(model(), {});
    ASSERT_TRUE(lock.ok()) << lock.status();
    EXPECT_THAT(lock->stale_holder(),
                HasSubstr("unknown to kvcal (the lock file holds \"garbage "
                          "{not json\")"));
  }
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
  // Held by a process that wrote garbage: refused (after the short grace
  // an unnamed holder gets), the garbage quoted.
  fs::create_directories(model() + "/.kvcal-patch");
  WriteFile(CheckpointLockPath(model()), "garbage");
  const int fd = ::open(CheckpointLockPath(model()).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);
  auto refused = CheckpointLock::Acquire(model(), {});
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("locked by a process unknown to kvcal (the lock file "
                        "holds \"garbage\")"));
  ::close(fd);
}

TEST_F(CheckpointLockTest, ReadersShareTheLockAndKeepWritersOut) {
  MakeModel(/*sharded=*/true);
  auto r1 = CheckpointLock::Acquire(model(), SharedLock());
  auto r2 = CheckpointLock::Acquire(model(), SharedLock());
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_FALSE(PatchInProgress(model())->has_value())
      << "readers are not a patch in progress";
  auto writer = CheckpointLock::Acquire(model(), {});
  EXPECT_THAT(std::string(writer.status().message()),
              HasSubstr("another kvcal process reading it"));
  r1->Release();
  EXPECT_TRUE(fs::exists(CheckpointLockPath(model())))
      << "a reader removed the lock another reader holds";
  r2->Release();
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"))
      << "the last reader leaves nothing";
  // A writer keeps readers out, naming itself.
  auto w = CheckpointLock::Acquire(model(), {});
  ASSERT_TRUE(w.ok());
  auto reader = CheckpointLock::Acquire(model(), SharedLock());
  EXPECT_THAT(std::string(reader.status().message()),
              HasSubstr("locked by pid " + kPid));
}

TEST_F(CheckpointLockTest, WhatIsInTheWayIsNamedAndLeftAlone) {
  MakeModel(/*sharded=*/true);
  const std::string staging = model() + "/.kvcal-patch";
  struct Case {
    const char* what;
    std::function<void()> make;
    const char* message;
  };
  const std::vector<Case> cases = {
      {".kvcal-patch is a file", [&] { WriteFile(staging, "mine"); },
       "exists and is not a directory"},
      {"the lock file is a symbolic link",
       [&] {
         fs::create_directories(staging);
         WriteFile(dir_ / "elsewhere", "precious");
         fs::create_symlink(dir_ / "elsewhere", CheckpointLockPath(model()));
       },
       "it is a symbolic link"},
      {"the lock file is a directory",
       [&] { fs::create_directories(CheckpointLockPath(model()) + "/x"); },
       "Is a directory"},
      {"the lock file is a FIFO",
       [&] {
         fs::create_directories(staging);
         ASSERT_EQ(::mkfifo(CheckpointLockPath(model()).c_str(), 0644), 0);
       },
       "is not a regular file"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    fs::remove_all(staging);
    c.make();
    const std::set<std::string> before = AllNames(model());
    auto lock = CheckpointLock::Acquire(model(), {});
    EXPECT_EQ(lock.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(lock.status().message()), HasSubstr(c.message));
    EXPECT_EQ(AllNames(model()), before);
    // A patch is refused the same way, the checkpoint untouched.
    PatchOptions options;
    options.checkpoint_dir = model();
    options.scales_path = scales_[0];
    EXPECT_THAT(std::string(PatchCheckpoint(options).status().message()),
                HasSubstr(c.message));
    EXPECT_EQ(AllNames(model()), before);
  }
  EXPECT_EQ(ReadFile(dir_ / "elsewhere"), "precious");
  EXPECT_EQ(CheckpointLock::Acquire(dir_ / "missing", {}).status().code(),
            absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------
// Item 1 through the binaries: refusal, waiting, calibrate, stale locks,
// inspect.

using PatchLockTest = SafetyTest;

// A patch paused at a step while other processes try the checkpoint.
class PausedPatch {
 public:
  PausedPatch(PatchOptions options, int pause_at) {
    options.on_step = [this, pause_at](int step) {
      if (step != pause_at) return;
      std::unique_lock<std::mutex> lock(mu_);
      paused_ = true;
      cv_.notify_all();
      cv_.wait(lock, [&] { return resumed_; });
    };
    thread_ =
        std::thread([this, options] { result_ = PatchCheckpoint(options); });
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return paused_; });
  }
  absl::StatusOr<PatchReport> Finish() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      resumed_ = true;
      cv_.notify_all();
    }
    thread_.join();
    return result_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool paused_ = false;
  bool resumed_ = false;
  std::thread thread_;
  absl::StatusOr<PatchReport> result_ = absl::UnknownError("not run");
};

TEST_F(PatchLockTest, ASecondPatchIsRefusedAndTheWinnersPatchStands) {
  MakeModel(/*sharded=*/true);
  PatchOptions winner;
  winner.checkpoint_dir = model();
  winner.scales_path = scales_[1];
  // Paused with the scales shard staged, before the commit point.
  PausedPatch running(winner, 2);
  ASSERT_TRUE(fs::exists(model() + "/.kvcal-patch/" + kScalesShardName));
  const Result loser = RunProcess(PatchArgs(2), log("loser"));
  EXPECT_EQ(loser.code, 1) << ResultText(loser);
  EXPECT_THAT(
      loser.err,
      ::testing::AllOf(HasSubstr("kvcal patch: checkpoint " + model() +
                                 " is locked by pid " + kPid + " on "),
                       HasSubstr("kvcal_checkpoint_safety_test"),
                       HasSubstr("not waiting for it (--lock-timeout 0)")));
  EXPECT_EQ(std::count(loser.err.begin(), loser.err.end(), '\n'), 1)
      << "one line: " << loser.err;
  // The staging area of the live patch was not touched.
  EXPECT_TRUE(fs::exists(model() + "/.kvcal-patch/" + kScalesShardName));
  // inspect says a patch is in progress.
  const Result during = Inspect("inspect-during");
  EXPECT_EQ(during.code, 1) << ResultText(during);
  // (inspect's findings on stdout, its errors on stderr)
  EXPECT_THAT(during.err,
              HasSubstr("kvcal inspect: error: a kvcal patch is in progress: "
                        "pid " +
                        kPid));
  // calibrate takes the lock before it reads config.json (or connects).
  const Result calibrate =
      RunProcess({KVCAL_CLI_PATH, "calibrate", "--server", "127.0.0.1:1",
                  "--checkpoint", model(), dir_ / "no-dumps"},
                 log("calibrate"));
  EXPECT_EQ(calibrate.code, 1) << ResultText(calibrate);
  EXPECT_THAT(calibrate.err, HasSubstr("is locked by pid " + kPid));
  auto finished = running.Finish();
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_TRUE(Snapshot(model()) == Sequential({1}))
      << "the checkpoint is not the winner's patch";
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
  const Result after = Inspect("inspect-after");
  EXPECT_EQ(after.code, 0) << ResultText(after);
}

TEST_F(PatchLockTest, LockTimeoutWaitsForTheHolder) {
  MakeModel(/*sharded=*/true);
  auto held = CheckpointLock::Acquire(model(), {});
  ASSERT_TRUE(held.ok());
  const Child waiting =
      Spawn(PatchArgs(3, {"--lock-timeout", "3600"}), log("waiting"));
  WaitForText(waiting.err_path,
              "waiting up to 1h for " + model() + ", locked by pid " + kPid);
  EXPECT_TRUE(Snapshot(model()) == Snapshot(dir_ / "pristine"));
  held->Release();
  const Result r = Wait(waiting);
  EXPECT_EQ(r.code, 0) << ResultText(r);
  EXPECT_TRUE(Snapshot(model()) == Sequential({3}));
  // Out-of-range values are refused at parse time.
  const Result negative =
      RunProcess(PatchArgs(3, {"--lock-timeout", "-1"}), log("negative"));
  EXPECT_NE(negative.code, 0);
  EXPECT_THAT(negative.err, HasSubstr("--lock-timeout"));
}

TEST_F(PatchLockTest, AKilledPatchsLockIsTakenOverAndItsPatchSettled) {
  MakeModel(/*sharded=*/true);
  // Killed before the commit point (scales shard staged), then after it
  // (the journal written): the next patch discards or completes it.
  for (const auto& [step, verdict] : std::vector<std::pair<int, std::string>>{
           {2, "discarded an interrupted patch that had not committed"},
           {6, "completed an interrupted patch (its journal was committed)"}}) {
    SCOPED_TRACE(verdict);
    Reset();
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      PatchOptions options;
      options.checkpoint_dir = model();
      options.scales_path = scales_[0];
      options.on_step = [step](int at) {
        if (at == step) ::raise(SIGKILL);
      };
      ::_exit(PatchCheckpoint(options).ok() ? 0 : 3);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the patch was not killed";
    ASSERT_EQ(fs::exists(model() + "/.kvcal-patch/COMMIT"), step == 6)
        << "killed at step " << step;
    const std::string dead = "pid " + std::to_string(pid);
    const Result inspect = Inspect("inspect-stale");
    EXPECT_EQ(inspect.code, 1);
    EXPECT_THAT(
        inspect.err,
        HasSubstr("error: an interrupted kvcal patch left .kvcal-patch/ "
                  "(its holder, " +
                  dead));
    const Result r = RunProcess(PatchArgs(1), log("takeover"));
    EXPECT_EQ(r.code, 0) << ResultText(r);
    EXPECT_THAT(r.out,
                HasSubstr("took over a stale lock (its holder, " + dead));
    EXPECT_THAT(r.out, HasSubstr(verdict));
    // Discarded: scales 1 on the pristine checkpoint; completed: 0 then 1.
    EXPECT_TRUE(Snapshot(model()) ==
                (step == 2 ? Sequential({1}) : Sequential({0, 1})));
    EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
  }
}

TEST_F(PatchLockTest, CopiesWithOutShareTheSourceAndKeepWritersOut) {
  MakeModel(/*sharded=*/true);
  auto reader = CheckpointLock::Acquire(model(), SharedLock());
  ASSERT_TRUE(reader.ok());
  // Another copy runs beside a reader...
  const Result copy =
      RunProcess(PatchArgs(0, {"--out", dir_ / "copy"}), log("copy"));
  EXPECT_EQ(copy.code, 0) << ResultText(copy);
  // ...an in-place writer does not.
  const Result writer = RunProcess(PatchArgs(0), log("writer"));
  EXPECT_EQ(writer.code, 1) << ResultText(writer);
  EXPECT_THAT(writer.err, HasSubstr("another kvcal process reading it"));
  reader->Release();
  EXPECT_TRUE(Snapshot(model()) == Snapshot(dir_ / "pristine"));
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
}

TEST_F(PatchLockTest, TwoCopiesIntoOneOutDirDoNotMix) {
  MakeModel(/*sharded=*/true);
  const std::string copy = dir_ / "copy";
  PatchOptions first;
  first.checkpoint_dir = model();
  first.scales_path = scales_[1];
  first.out_dir = copy;
  PausedPatch running(first, 2);  // its copy.kvcal-partial half built
  const std::set<std::string> partial = AllNames(copy + ".kvcal-partial");
  const Result second =
      RunProcess(PatchArgs(2, {"--out", copy}), log("second-copy"));
  EXPECT_EQ(second.code, 1) << ResultText(second);
  EXPECT_THAT(second.err, HasSubstr("another kvcal patch is writing " + copy +
                                    " (" + copy + ".kvcal-partial is locked)"));
  EXPECT_EQ(AllNames(copy + ".kvcal-partial"), partial)
      << "the live copy's staging directory was touched";
  auto finished = running.Finish();
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_TRUE(Snapshot(copy) == Sequential({1}));
  // Later, the finished copy is not overwritten, and nothing is left over.
  const Result third =
      RunProcess(PatchArgs(2, {"--out", copy + "/"}), log("third-copy"));
  EXPECT_EQ(third.code, 1) << ResultText(third);
  EXPECT_THAT(third.err, HasSubstr("output directory " + copy +
                                   " exists and is not empty"));
  EXPECT_FALSE(fs::exists(copy + ".kvcal-partial"));
  EXPECT_TRUE(Snapshot(copy) == Sequential({1}));
  EXPECT_TRUE(Snapshot(model()) == Snapshot(dir_ / "pristine"));
}

// ---------------------------------------------------------------------------
// Item 7: a failed patch cleans up; a failure after the commit point says
// how to complete it.

using PatchCleanupTest = SafetyTest;

bool HasTempFiles(const std::string& dir) {
  for (const std::string& name : AllNames(dir)) {
    if (name.ends_with(kOutputTempSuffix)) return true;
  }
  return false;
}

TEST_F(PatchCleanupTest, AFileSizeLimitDuringThePatchLeavesNothingStaged) {
  MakeModel(/*sharded=*/false);  // model.safetensors is rewritten whole
  const uintmax_t size = fs::file_size(model() + "/model.safetensors");
  ASSERT_GT(size, 16384u);
  const long limit = static_cast<long>(size / 2);
  // In place: the rewritten model.safetensors hits the limit.
  Result r = RunProcess(PatchArgs(0), log("fsize"), limit);
  EXPECT_EQ(r.code, 1) << ResultText(r);
  EXPECT_THAT(r.err, HasSubstr("File too large"));
  EXPECT_THAT(r.err, HasSubstr(model() + " is unchanged and the staged files "
                                         "were removed"));
  EXPECT_TRUE(Snapshot(model()) == Snapshot(dir_ / "pristine"));
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
  EXPECT_FALSE(HasTempFiles(model()));
  // With --out: no partial copy is left either.
  r = RunProcess(PatchArgs(0, {"--out", dir_ / "copy"}), log("fsize-out"),
                 limit);
  EXPECT_EQ(r.code, 1) << ResultText(r);
  EXPECT_THAT(r.err, HasSubstr("File too large"));
  EXPECT_FALSE(fs::exists(dir_ / "copy"));
  EXPECT_FALSE(fs::exists(dir_ / "copy.kvcal-partial"));
  EXPECT_TRUE(Snapshot(model()) == Snapshot(dir_ / "pristine"));
  // Without the limit the same command works.
  r = RunProcess(PatchArgs(0), log("no-limit"));
  EXPECT_EQ(r.code, 0) << ResultText(r);
  EXPECT_TRUE(Snapshot(model()) == Sequential({0}));
}

TEST_F(PatchCleanupTest, AFailureAfterTheCommitPointNamesJournalAndCommand) {
  MakeModel(/*sharded=*/true);
  // A directory where the new scales shard goes: the journal is written,
  // then its first rename fails.
  fs::create_directories(model() + "/" + kScalesShardName + "/in-the-way");
  Result r = RunProcess(PatchArgs(2), log("post-commit"));
  EXPECT_EQ(r.code, 1) << ResultText(r);
  const std::string journal = model() + "/.kvcal-patch/COMMIT";
  EXPECT_THAT(r.err, HasSubstr("committed but did not complete"));
  EXPECT_THAT(r.err, HasSubstr("its journal " + journal));
  const std::string command =
      "kvcal patch --checkpoint " + model() + " --scales " + scales_[2];
  EXPECT_THAT(r.err, HasSubstr("run `" + command + "`"));
  EXPECT_TRUE(fs::exists(journal));
  const Result inspect = Inspect("inspect-post-commit");
  EXPECT_EQ(inspect.code, 1);
  EXPECT_THAT(inspect.err, HasSubstr("interrupted kvcal patch"));
  // Rerun while the cause is still there: the same advice, nothing lost.
  r = RunProcess(PatchArgs(2), log("post-commit-again"));
  EXPECT_EQ(r.code, 1) << ResultText(r);
  EXPECT_THAT(r.err, HasSubstr("its journal " + journal));
  EXPECT_THAT(r.err, HasSubstr("run `" + command + "`"));
  // Fixed, the printed command completes the patch.
  fs::remove_all(model() + "/" + kScalesShardName);
  std::vector<std::string> args = absl::StrSplit(command, ' ');
  args[0] = KVCAL_CLI_PATH;
  r = RunProcess(args, log("completion"));
  EXPECT_EQ(r.code, 0) << ResultText(r);
  EXPECT_THAT(r.out, HasSubstr("completed an interrupted patch"));
  EXPECT_TRUE(Snapshot(model()) == Sequential({2}));
  EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
}

// ---------------------------------------------------------------------------
// Item 3 through the binaries: `kvcal report -o`, `kvcal-worker --port-file`.

using OutputFileCliTest = SafetyTest;

TEST_F(OutputFileCliTest, ReportWritesThroughLinksAndRefusesTheRest) {
  MakeModel(/*sharded=*/true);
  auto report = [&](const std::string& out, const std::string& stem) {
    return RunProcess(
        {KVCAL_CLI_PATH, "report", "--scales", scales_[1], "-o", out},
        log(stem));
  };
  // A link: the link stays, the file it names gets the report.
  fs::create_directories(dir_ / "reports");
  WriteFile(dir_ / "reports/real.html", "old");
  fs::create_symlink("reports/real.html", dir_ / "latest.html");
  Result r = report(dir_ / "latest.html", "link");
  EXPECT_EQ(r.code, 0) << ResultText(r);
  EXPECT_TRUE(fs::is_symlink(dir_ / "latest.html"));
  EXPECT_THAT(ReadFile(dir_ / "reports/real.html"), HasSubstr("<html"));
  // Not regular files: refused, left as they were.
  ASSERT_EQ(::mkfifo((dir_ / "fifo").c_str(), 0644), 0);
  fs::create_directories(dir_ / "a-dir");
  for (const auto& [target, kind] :
       std::vector<std::pair<std::string, std::string>>{
           {dir_ / "fifo", "a FIFO"}, {dir_ / "a-dir", "a directory"}}) {
    SCOPED_TRACE(target);
    r = report(target, "refused");
    EXPECT_EQ(r.code, 1) << ResultText(r);
    EXPECT_THAT(r.err,
                HasSubstr("refusing to write " + target + ": it is " + kind));
  }
  EXPECT_TRUE(fs::is_fifo(dir_ / "fifo"));
  EXPECT_TRUE(fs::is_directory(dir_ / "a-dir"));
  r = report(dir_ / "no/such/dir/r.html", "missing");
  EXPECT_EQ(r.code, 1) << ResultText(r);
  EXPECT_THAT(r.err, HasSubstr("directory " + (dir_ / "no/such/dir") +
                               " does not exist"));
  // The report's own input is not replaced.
  const std::string scales_bytes = ReadFile(scales_[1]);
  r = report(scales_[1], "input");
  EXPECT_EQ(r.code, 1) << ResultText(r);
  EXPECT_THAT(r.err, HasSubstr("is the input"));
  EXPECT_EQ(ReadFile(scales_[1]), scales_bytes);
}

#ifdef KVCAL_WORKER_PATH
TEST_F(OutputFileCliTest, WorkerPortFileGoesThroughTheOneWriter) {
  // Through a link: the link stays, its file holds the port.
  fs::create_directories(dir_ / "run");
  fs::create_symlink("run/port", dir_ / "port-link");
  const Child worker = Spawn({KVCAL_WORKER_PATH, "--listen", "127.0.0.1:0",
                              "--port-file", dir_ / "port-link"},
                             log("worker"));
  while (ReadFile(dir_ / "run/port").empty())
    absl::SleepFor(absl::Milliseconds(5));
  int port = 0;
  EXPECT_TRUE(absl::SimpleAtoi(
      absl::StripAsciiWhitespace(ReadFile(dir_ / "run/port")), &port));
  EXPECT_GT(port, 0);
  EXPECT_TRUE(fs::is_symlink(dir_ / "port-link"));
  ::kill(worker.pid, SIGTERM);
  EXPECT_EQ(Wait(worker).code, 0);
  // A directory: refused, one line, exit 1.
  fs::create_directories(dir_ / "port-dir");
  const Result r = RunProcess({KVCAL_WORKER_PATH, "--listen", "127.0.0.1:0",
                               "--port-file", dir_ / "port-dir"},
                              log("worker-dir"));
  EXPECT_EQ(r.code, 1) << ResultText(r);
  EXPECT_THAT(r.err, HasSubstr("--port-file: refusing to write " +
                               (dir_ / "port-dir") + ": it is a directory"));
  EXPECT_TRUE(fs::is_directory(dir_ / "port-dir"));
}
#endif

// ---------------------------------------------------------------------------
// The stress test: rounds of concurrent `kvcal patch` processes with
// different scales on one checkpoint. After each round the checkpoint is,
// byte for byte, what the same patches give one after the other in some
// order, and `kvcal inspect` passes.

using PatchConcurrencyTest = SafetyTest;

constexpr int kRounds = 20;

void ConcurrentRounds(PatchConcurrencyTest& t, int writers) {
  t.MakeModel(/*sharded=*/true);
  int failures = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    t.Reset();
    std::vector<Child> children;
    for (int i = 0; i < writers; ++i) {
      children.push_back(Spawn(t.PatchArgs(i, {"--lock-timeout", "600"}),
                               t.log(absl::StrCat("w", writers, "-", i))));
    }
    std::vector<int> all;
    for (int i = 0; i < writers; ++i) {
      const Result r = Wait(children[i]);
      EXPECT_EQ(r.code, 0) << "writer " << i << ": " << ResultText(r);
      if (r.code != 0) ++failures;
      all.push_back(i);
    }
    EXPECT_FALSE(fs::exists(t.model() + "/.kvcal-patch"));
    const Tree state = Snapshot(t.model());
    const bool ordered = t.SomeOrder(all, state);
    EXPECT_TRUE(ordered) << "no order of the patches gives this checkpoint";
    if (!ordered) ++failures;
    const Result inspect = t.Inspect("inspect");
    EXPECT_EQ(inspect.code, 0) << ResultText(inspect);
    if (inspect.code != 0) ++failures;
  }
  std::cout << "[ stress ] " << kRounds << " rounds of " << writers
            << " concurrent kvcal patch processes: " << failures
            << " failures\n";
}

TEST_F(PatchConcurrencyTest, TwoWritersTwentyRounds) {
  ConcurrentRounds(*this, 2);
}

TEST_F(PatchConcurrencyTest, FourWritersTwentyRounds) {
  ConcurrentRounds(*this, 4);
}

// Without --lock-timeout a writer that meets the lock refuses at once,
// naming the other; the checkpoint is what the writers that ran wrote.
TEST_F(PatchConcurrencyTest, DefaultTimeoutRefusesNamingTheHolder) {
  MakeModel(/*sharded=*/true);
  int refused = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    Reset();
    const Child a = Spawn(PatchArgs(0), log("a"));
    const Child b = Spawn(PatchArgs(1), log("b"));
    const Result ra = Wait(a);
    const Result rb = Wait(b);
    std::vector<int> ran;
    for (const auto& [i, r, other] :
         {std::tuple{0, ra, b.pid}, std::tuple{1, rb, a.pid}}) {
      if (r.code == 0) {
        ran.push_back(i);
        continue;
      }
      ++refused;
      EXPECT_EQ(r.code, 1) << ResultText(r);
      EXPECT_THAT(r.err, HasSubstr("is locked by pid " + std::to_string(other)))
          << ResultText(r);
    }
    EXPECT_FALSE(ran.empty()) << "both refused";
    EXPECT_FALSE(fs::exists(model() + "/.kvcal-patch"));
    EXPECT_TRUE(SomeOrder(ran, Snapshot(model())));
    EXPECT_EQ(Inspect("inspect").code, 0);
  }
  std::cout << "[ stress ] " << kRounds
            << " rounds of 2 writers, no wait: " << refused
            << " refusals naming the holder, the rest serialized\n";
}

}  // namespace
}  // namespace kvcal
