// Test certificates made with the openssl command line (./run installs it):
// a CA, and server and client certificates it signed for 127.0.0.1 and
// localhost, valid for two days.
//
//   ASSERT_TRUE(kvcal::testing::MakeTestCertificates(dir));
//   // dir/ca.pem, dir/server.{pem,key}, dir/client.{pem,key}
#ifndef KVCAL_TESTS_TEST_CERTS_H_
#define KVCAL_TESTS_TEST_CERTS_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace kvcal::testing {

inline bool MakeTestCertificates(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  const std::string script =
      "set -e; cd '" + dir.string() +
      "'; "
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem "
      "-days 2 -subj /CN=kvcal-test-ca 2>/dev/null; "
      "for n in server client; do "
      "openssl req -newkey rsa:2048 -nodes -keyout $n.key -out $n.csr "
      "-subj /CN=$n 2>/dev/null; "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > $n.ext; "
      "openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key "
      "-CAcreateserial -out $n.pem -days 2 -extfile $n.ext 2>/dev/null; "
      "done";
  const std::filesystem::path script_path = dir / "make_certs.sh";
  std::ofstream(script_path) << script;
  return std::system(("bash '" + script_path.string() + "'").c_str()) == 0;
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_TEST_CERTS_H_
