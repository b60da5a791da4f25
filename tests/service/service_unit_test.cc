// Unit tests of the worker's pieces that need no server: token parsing,
// session ids, the registry's limits, proto conversion defaults.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/auth.h"
#include "service/proto_convert.h"
#include "service/session_registry.h"

namespace kvcal::service {
namespace {

using ::testing::HasSubstr;

TEST(TokenAuthenticatorTest, ParsesTenantsAndBareTokens) {
  auto auth = TokenAuthenticator::FromText("# comment\n\nteam:abc\nxyz\n");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ(*auth->Authenticate("Bearer abc"), "team");
  EXPECT_EQ(*auth->Authenticate("BEARER xyz"), "default");
  EXPECT_EQ(auth->Authenticate("Bearer ab").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(auth->Authenticate("abc").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_FALSE(TokenAuthenticator::FromText("team:\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromText("\n# only comments\n").ok());
  // The message never repeats the presented token.
  EXPECT_THAT(
      std::string(auth->Authenticate("Bearer leaked").status().message()),
      ::testing::Not(HasSubstr("leaked")));
}

TEST(SessionIdTest, Validation) {
  EXPECT_TRUE(ValidateSessionId("a-Z_0.9", false).ok());
  EXPECT_TRUE(ValidateSessionId("", true).ok());
  EXPECT_FALSE(ValidateSessionId("", false).ok());
  EXPECT_FALSE(ValidateSessionId("a/b", false).ok());
  EXPECT_TRUE(ValidateSessionId(std::string(128, 'x'), false).ok());
  EXPECT_FALSE(ValidateSessionId(std::string(129, 'x'), false).ok());
}

TEST(SessionRegistryTest, LimitsAreResourceExhausted) {
  RegistryOptions options;
  options.session.backend = BackendKind::kCpu;
  options.max_sessions = 1;
  SessionRegistry registry(options);
  Geometry g{2, 4, 2, 8, 0, 0b111};
  ASSERT_TRUE(registry.Create("t", "a", g).ok());
  auto second = registry.Create("t", "b", g);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("--max-sessions"));

  RegistryOptions budget;
  budget.session.backend = BackendKind::kCpu;
  budget.memory_budget_bytes = EstimateStateBytes(g) + 1;
  SessionRegistry small(budget);
  ASSERT_TRUE(small.Create("t", "a", g).ok());
  Geometry with_histograms = g;
  with_histograms.bins_per_octave = 128;
  EXPECT_EQ(small.Create("t", "b", with_histograms).status().code(),
            absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(small.Delete("t", "a").ok());
  EXPECT_TRUE(small.Create("t", "b", g).ok()) << "deleting frees the budget";
}

TEST(SessionRegistryTest, TenantsAreIsolatedAndLimitedSeparately) {
  RegistryOptions options;
  options.session.backend = BackendKind::kCpu;
  options.max_sessions_per_tenant = 1;
  SessionRegistry registry(options);
  Geometry g{2, 4, 2, 8, 0, 0b111};
  ASSERT_TRUE(registry.Create("a", "shared-name", g).ok());
  // Another tenant has its own namespace: same id, no conflict, no leak.
  Geometry other = g;
  other.head_dim = 16;
  ASSERT_TRUE(registry.Create("b", "shared-name", other).ok());
  EXPECT_EQ(registry.Get("a", "shared-name").value()->geometry().head_dim, 8u);
  EXPECT_EQ(registry.Get("b", "shared-name").value()->geometry().head_dim, 16u);
  EXPECT_EQ(registry.Get("c", "shared-name").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.List("a").size(), 1u);
  EXPECT_EQ(registry.List("c").size(), 0u);
  EXPECT_EQ(registry.ListAll().size(), 2u);
  EXPECT_EQ(registry.Delete("c", "shared-name").code(),
            absl::StatusCode::kNotFound);
  auto second = registry.Create("a", "another", g);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(second.status().message()),
              HasSubstr("--max-sessions-per-tenant"));
  EXPECT_TRUE(registry.Create("c", "another", g).ok());
}

TEST(TokenAuthenticatorTest, RejectsBadTenantNames) {
  EXPECT_FALSE(TokenAuthenticator::FromText("a b:token\n").ok());
  EXPECT_FALSE(TokenAuthenticator::FromText("x~y:token\n").ok());
  EXPECT_TRUE(TokenAuthenticator::FromText("team.a-1_b:token\n").ok());
}

TEST(ProtoConvertTest, FinalizeDefaultsAndRanges) {
  kvcal::v1::FinalizeRequest request;
  auto options = ScaleOptionsFromProto(request);
  ASSERT_TRUE(options.ok());
  EXPECT_EQ(options->observer, Observer::kStaticMinMax);
  EXPECT_EQ(options->granularity, Granularity::kPerTensor);
  EXPECT_EQ(options->format, Format::kFp8E4m3fn);
  EXPECT_FLOAT_EQ(options->averaging_constant, 0.01f);
  EXPECT_DOUBLE_EQ(options->percentile, 99.99);
  EXPECT_EQ(options->mse_grid, 100u);
  EXPECT_FLOAT_EQ(options->mse_max_shrink, 0.2f);
  EXPECT_FLOAT_EQ(options->mse_norm, 2.4f);
  EXPECT_EQ(options->mse_patience, 5u);
  request.set_mse_max_shrink(1.0f);
  EXPECT_THAT(std::string(ScaleOptionsFromProto(request).status().message()),
              HasSubstr("mse_max_shrink"));
  request.set_mse_max_shrink(0);
  request.set_margin(-1.0f);
  EXPECT_THAT(std::string(ScaleOptionsFromProto(request).status().message()),
              HasSubstr("margin"));
  request.set_margin(0);
  request.set_format(static_cast<kvcal::v1::Format>(5));
  EXPECT_THAT(std::string(ScaleOptionsFromProto(request).status().message()),
              HasSubstr("format"));
}

}  // namespace
}  // namespace kvcal::service
