// WriteOutputFile, the one way kvcal writes an output file: what it replaces,
// what it refuses, and that a failed write leaves nothing behind.
#include "util/file_io.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcal {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class FileIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/kvcal-file-io-test-XXXXXX";
    ASSERT_NE(::mkdtemp(name), nullptr);
    dir_ = name;
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(dir_, ignored);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  static std::string Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  static void Write(const std::string& path, const std::string& contents) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << contents;
  }
  // The names in the test directory: a temporary file left behind shows.
  std::set<std::string> Names() const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) {
      names.insert(e.path().filename().string());
    }
    return names;
  }

  std::string dir_;
};

TEST_F(FileIoTest, CreatesAndReplacesARegularFileLeavingNoTemporaryFile) {
  ASSERT_TRUE(WriteOutputFile(Path("out.bin"), "first").ok());
  EXPECT_EQ(Read(Path("out.bin")), "first");
  ASSERT_TRUE(WriteOutputFile(Path("out.bin"), "second, longer").ok());
  EXPECT_EQ(Read(Path("out.bin")), "second, longer");
  EXPECT_EQ(Names(), std::set<std::string>{"out.bin"});
  EXPECT_TRUE(CheckOutputPath(Path("out.bin")).ok());
  EXPECT_TRUE(CheckOutputPath(Path("new.bin")).ok());
}

TEST_F(FileIoTest, KeepsTheModeOfTheFileItReplaces) {
  Write(Path("secret"), "old");
  ASSERT_EQ(::chmod(Path("secret").c_str(), 0600), 0);
  ASSERT_TRUE(WriteOutputFile(Path("secret"), "new").ok());
  struct stat st;
  ASSERT_EQ(::stat(Path("secret").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST_F(FileIoTest, WritesThroughSymbolicLinks) {
  // A relative link, a chain of two, and an absolute one.
  fs::create_directories(Path("real"));
  Write(Path("real/target"), "old");
  fs::create_symlink("real/target", Path("link"));
  fs::create_symlink("link", Path("link2"));
  fs::create_symlink(Path("real/target"), Path("abs"));
  for (const char* name : {"link", "link2", "abs"}) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(WriteOutputFile(Path(name), std::string("via ") + name).ok());
    EXPECT_TRUE(fs::is_symlink(Path(name))) << "the link was replaced";
    EXPECT_EQ(Read(Path("real/target")), std::string("via ") + name);
  }
  // A dangling link: the file it points to is created.
  fs::create_symlink("real/created", Path("dangling"));
  ASSERT_TRUE(WriteOutputFile(Path("dangling"), "made").ok());
  EXPECT_TRUE(fs::is_symlink(Path("dangling")));
  EXPECT_EQ(Read(Path("real/created")), "made");
  // Temporary files went beside the target, and are gone.
  std::set<std::string> real;
  for (const auto& e : fs::directory_iterator(Path("real"))) {
    real.insert(e.path().filename().string());
  }
  EXPECT_EQ(real, (std::set<std::string>{"created", "target"}));
  // A loop is an error, not a hang.
  fs::create_symlink("loop-b", Path("loop-a"));
  fs::create_symlink("loop-a", Path("loop-b"));
  EXPECT_THAT(std::string(WriteOutputFile(Path("loop-a"), "x").message()),
              HasSubstr("too many levels of symbolic links"));
}

// Every kind of file that is not a regular one: refused before anything is
// created, the node left as it was, nothing else in the directory.
TEST_F(FileIoTest, RefusesDirectoriesFifosSocketsAndDevices) {
  fs::create_directories(Path("a-directory"));
  Write(Path("a-directory/inside"), "kept");
  ASSERT_EQ(::mkfifo(Path("a-fifo").c_str(), 0644), 0);
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string sock_path = Path("a-socket");
  ASSERT_LT(sock_path.size(), sizeof(addr.sun_path));
  std::strcpy(addr.sun_path, sock_path.c_str());
  ASSERT_EQ(::bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  struct Case {
    std::string name;
    std::string kind;
  };
  std::vector<Case> cases = {{"a-directory", "a directory"},
                             {"a-fifo", "a FIFO"},
                             {"a-socket", "a socket"}};
  // A character device node like /dev/null (1, 3), made here rather than
  // aimed at the real one; mknod needs CAP_MKNOD, so without it this case
  // is left out and says so.
  if (::mknod(Path("a-device").c_str(), S_IFCHR | 0644, makedev(1, 3)) == 0) {
    cases.push_back({"a-device", "a character device"});
  } else {
    std::cout << "[ note ] mknod: " << std::strerror(errno)
              << "; the character-device case does not run here\n";
  }
  fs::create_symlink("a-fifo", Path("link-to-fifo"));
  cases.push_back({"link-to-fifo", "a FIFO"});
  const std::set<std::string> before = Names();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const absl::Status check = CheckOutputPath(Path(c.name));
    const absl::Status status = WriteOutputFile(Path(c.name), "data");
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("it is " + c.kind + ", and kvcal replaces only"));
    EXPECT_EQ(check, status);
    EXPECT_EQ(Names(), before) << "something was created or removed";
  }
  EXPECT_TRUE(fs::is_directory(Path("a-directory")));
  EXPECT_EQ(Read(Path("a-directory/inside")), "kept");
  EXPECT_TRUE(fs::is_fifo(Path("a-fifo")));
  EXPECT_TRUE(fs::is_socket(Path("a-socket")));
  EXPECT_TRUE(fs::is_symlink(Path("link-to-fifo")));
  if (fs::exists(Path("a-device"))) {
    EXPECT_TRUE(fs::is_character_file(Path("a-device")));
  }
  ::close(sock);
}

TEST_F(FileIoTest, BadPathsAreClearErrors) {
  absl::Status s = WriteOutputFile(Path("missing/out.html"), "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("directory " + Path("missing") + " does not exist"));
  EXPECT_EQ(CheckOutputPath(Path("missing/out.html")).code(),
            absl::StatusCode::kNotFound);
  s = WriteOutputFile(Path("dir/"), "x");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("ends in '/'"));
  EXPECT_EQ(WriteOutputFile("", "x").code(),
            absl::StatusCode::kInvalidArgument);
  Write(Path("plain"), "file");
  s = WriteOutputFile(Path("plain/out"), "x");  // a parent that is a file
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("Not a directory"));
  EXPECT_EQ(Names(), std::set<std::string>{"plain"});
}

TEST_F(FileIoTest, AFailedWriteRemovesItsTemporaryFileAndKeepsTheTarget) {
  Write(Path("out"), "original");
  std::string temp_seen;
  const absl::Status status =
      WriteOutputFile(Path("out"), [&](int fd, const std::string& temp) {
        temp_seen = temp;
        EXPECT_TRUE(WriteAll(fd, "half", 4, temp).ok());
        EXPECT_TRUE(fs::exists(temp));
        return absl::DataLossError("the writer gave up");
      });
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(status.message()),
              HasSubstr("the writer gave up (" + Path("out") +
                        " is unchanged; the temporary file was removed)"));
  EXPECT_THAT(temp_seen, ::testing::EndsWith(kOutputTempSuffix));
  EXPECT_EQ(fs::path(temp_seen).parent_path(), fs::path(dir_));
  EXPECT_EQ(Read(Path("out")), "original");
  EXPECT_EQ(Names(), std::set<std::string>{"out"});
}

// A file-size limit (what a full disk looks like to a writer: EFBIG with
// SIGXFSZ ignored), in a child process so the limit stays there.
TEST_F(FileIoTest, AFileSizeLimitFailsTheWriteAndLeavesNothing) {
  Write(Path("out"), "original");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    const struct rlimit limit = {4096, 4096};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(10);
    const absl::Status s =
        WriteOutputFile(Path("out"), std::string(1 << 20, 'x'));
    if (s.ok()) ::_exit(11);
    if (std::string(s.message()).find("File too large") == std::string::npos) {
      ::_exit(12);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10: setrlimit failed, 11: the write succeeded, 12: another error";
  EXPECT_EQ(Read(Path("out")), "original");
  EXPECT_EQ(Names(), std::set<std::string>{"out"});
}

TEST_F(FileIoTest, SameFileFollowsLinks) {
  Write(Path("a"), "x");
  fs::create_symlink("a", Path("l"));
  Write(Path("b"), "x");
  EXPECT_TRUE(SameFile(Path("a"), Path("l")));
  EXPECT_FALSE(SameFile(Path("a"), Path("b")));
  EXPECT_FALSE(SameFile(Path("a"), Path("missing")));
}

TEST_F(FileIoTest, RenamePathMovesAndNamesBothPathsOnFailure) {
  std::ofstream(Path("a")) << "x";
  ASSERT_TRUE(RenamePath(Path("a"), Path("b")).ok());
  EXPECT_FALSE(fs::exists(Path("a")));
  EXPECT_TRUE(fs::exists(Path("b")));
  const absl::Status missing = RenamePath(Path("gone"), Path("c"));
  EXPECT_EQ(missing.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(missing.message(), HasSubstr(Path("gone")));
  EXPECT_THAT(missing.message(), HasSubstr(Path("c")));
}

TEST_F(FileIoTest, CopyFileOrTreeSyncedCopiesFilesAndTreesAndCountsFileBytes) {
  std::ofstream(Path("file")) << "12345";
  std::ofstream(Path("old")) << "longer old contents";
  std::vector<uint64_t> counted;
  ASSERT_TRUE(CopyFileOrTreeSynced(Path("file"), Path("old"), [&](uint64_t n) {
                counted.push_back(n);
              }).ok());
  std::ifstream copy(Path("old"));
  std::string text((std::istreambuf_iterator<char>(copy)), {});
  EXPECT_EQ(text, "12345");  // replaced, not appended to
  EXPECT_EQ(counted, std::vector<uint64_t>{5});
  fs::create_directories(Path("tree/sub"));
  std::ofstream(Path("tree/sub/f")) << "abc";
  ASSERT_TRUE(CopyFileOrTreeSynced(Path("tree"), Path("tree2")).ok());
  EXPECT_TRUE(fs::exists(Path("tree2/sub/f")));
  EXPECT_EQ(CopyFileOrTreeSynced(Path("none"), Path("x")).code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvcal
