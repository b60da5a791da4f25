// Linked into every executable of a KVCAL_STATIC_RUNTIME build (the GPU
// bundle). The static libstdc++ of GCC 12 on Debian 12 calls arc4random()
// (std::random_device), which glibc has only since 2.36; Ubuntu 22.04 has
// 2.35. This definition satisfies that reference inside the executable, so
// the binaries need glibc 2.35 at most (make_gpu_bundle.sh checks it).
#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>

extern "C" uint32_t arc4random(void) {
  uint32_t value = 0;
  for (;;) {
    const ssize_t n = getrandom(&value, sizeof(value), 0);  // glibc 2.25
    if (n == static_cast<ssize_t>(sizeof(value))) return value;
    if (n < 0 && errno != EINTR) std::abort();  // no entropy source at all
  }
}
