// The tests' one poll-with-deadline loop: waits for something another
// process or thread does (a port file written, a watermark durable, a child
// exited) without assuming how long it takes.
//
//   ASSERT_TRUE(WaitUntil([&] { return fs::exists(file); },
//                         std::chrono::seconds(10)));
//   int status = 0;
//   if (!WaitUntil([&] { return waitpid(pid, &status, WNOHANG) == pid; },
//                  timeout, std::chrono::milliseconds(5))) { ... }
//
// The timeout is a failure bound, not a measurement: tests assert on what
// the predicate saw, never on how long it took.
#ifndef KVCAL_TESTS_WAIT_UNTIL_H_
#define KVCAL_TESTS_WAIT_UNTIL_H_

#include <chrono>
#include <thread>

namespace kvcal::testing {

// Calls `predicate` until it returns true (then true) or `timeout` has
// passed (then false), sleeping `poll` between calls (zero: yields the
// thread instead, for a counter another thread bumps quickly). The predicate
// is called at least once, and once more after the deadline has passed, so a
// condition that became true while the caller slept is not missed.
template <typename Predicate>
bool WaitUntil(
    Predicate&& predicate, std::chrono::steady_clock::duration timeout,
    std::chrono::steady_clock::duration poll = std::chrono::milliseconds(20)) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const bool past_deadline = std::chrono::steady_clock::now() >= deadline;
    if (predicate()) return true;
    if (past_deadline) return false;
    if (poll.count() > 0) {
      std::this_thread::sleep_for(poll);
    } else {
      std::this_thread::yield();
    }
  }
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_WAIT_UNTIL_H_
