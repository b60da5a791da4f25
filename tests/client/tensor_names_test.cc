// The one module that builds and parses tensor names (client/checkpoint/tensor_names.h):
// the literal names each convention writes, pinned here independently of the
// implementation, and their round trips.
#include "client/checkpoint/tensor_names.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvcal {
namespace {

using ::testing::HasSubstr;

TEST(TensorNamesTest, ActivationAndScalesFileNames) {
  EXPECT_EQ(ActivationTensorName(3, Role::kK), "model.layers.3.self_attn.k");
  EXPECT_EQ(ScaleTensorName(0, Role::kQ), "model.layers.0.self_attn.q_scale");
  EXPECT_EQ(ScaleTensorName(4294967295u, Role::kV),
            "model.layers.4294967295.self_attn.v_scale");
  for (uint32_t layer : {0u, 7u, 4294967295u}) {
    for (Role role : kAllRoles) {
      auto a = ParseActivationTensorName(ActivationTensorName(layer, role));
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_EQ(*a, (LayerRole{layer, role}));
      auto s = ParseScaleTensorName(ScaleTensorName(layer, role));
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(*s, (LayerRole{layer, role}));
    }
  }
}

TEST(TensorNamesTest, ParseErrorsNameTheTensorAndWhatWasWrong) {
  for (const char* bad :
       {"model.layers.3.self_attn.k_scale", "model.layers.x.self_attn.k",
        "model.layers.3.self_attn.o", "layers.3.self_attn.k", ""}) {
    auto a = ParseActivationTensorName(bad);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(a.status().message(),
                HasSubstr("is not named model.layers.{L}.self_attn.{q,k,v}"));
    EXPECT_THAT(a.status().message(), HasSubstr(std::string("'") + bad + "'"));
  }
  EXPECT_THAT(
      ParseScaleTensorName("model.layers.3.self_attn.k").status().message(),
      HasSubstr("is not named model.layers.{L}.self_attn.{q,k,v}_scale"));
  EXPECT_THAT(ParseActivationTensorName("model.layers.4294967296.self_attn.q")
                  .status()
                  .message(),
              HasSubstr("layer number out of range"));
  EXPECT_THAT(ParseScaleTensorName(
                  "model.layers.99999999999999999999.self_attn.q_scale")
                  .status()
                  .message(),
              HasSubstr("layer number out of range"));
}

TEST(TensorNamesTest, CheckpointNamesPerTarget) {
  // What vLLM 0.34 loads for each target (client/checkpoint/vllm_rules.h and the
  // conformance tests check that it does).
  EXPECT_EQ(CheckpointScaleName(PatchTarget::kCompressedTensors, "model", 2,
                                Role::kK),
            "model.layers.2.self_attn.k_scale");
  EXPECT_EQ(CheckpointScaleName(PatchTarget::kModelOpt, "model", 2, Role::kQ),
            "model.layers.2.self_attn.q_scale");
  EXPECT_EQ(CheckpointScaleName(PatchTarget::kModelOpt, "model", 2, Role::kV),
            "model.layers.2.self_attn.v_proj.v_scale");
  EXPECT_EQ(CheckpointScaleName(PatchTarget::kQuark, "model.language_model", 1,
                                Role::kQ),
            "model.language_model.layers.1.self_attn.q_proj.output_scale");
  for (PatchTarget target : {PatchTarget::kCompressedTensors,
                             PatchTarget::kModelOpt, PatchTarget::kQuark}) {
    for (Role role : kAllRoles) {
      const std::string name = CheckpointScaleName(target, "model", 5, role);
      std::optional<CheckpointScale> parsed = ParseCheckpointScaleName(name);
      ASSERT_TRUE(parsed.has_value()) << name;
      EXPECT_EQ(parsed->layer, 5u) << name;
      EXPECT_EQ(parsed->role, role) << name;
      // ModelOpt's q_scale is compressed-tensors' spelling too.
      if (!(target == PatchTarget::kModelOpt && role == Role::kQ)) {
        EXPECT_EQ(parsed->convention, target) << name;
      }
    }
  }
  // vLLM's own remapped form is recognized; weights and other tensors are not.
  ASSERT_TRUE(
      ParseCheckpointScaleName("model.layers.3.self_attn.attn.k_scale"));
  EXPECT_FALSE(
      ParseCheckpointScaleName("model.layers.3.self_attn.k_proj.weight"));
  EXPECT_FALSE(
      ParseCheckpointScaleName("model.layers.99999999999.self_attn.k_scale"));
}

TEST(TensorNamesTest, PatchTargetNamesRoundTrip) {
  for (const char* name : {"compressed-tensors", "modelopt", "quark"}) {
    auto target = ParsePatchTarget(name);
    ASSERT_TRUE(target.ok()) << target.status();
    EXPECT_EQ(PatchTargetName(*target), name);
  }
  EXPECT_THAT(ParsePatchTarget("fp8").status().message(),
              HasSubstr("unknown target 'fp8'"));
}

TEST(TensorNamesTest, AttentionPrefixIsTheCheckpointsOwn) {
  EXPECT_EQ(AttentionPrefix({"lm_head.weight",
                             "model.language_model.layers.0.self_attn.q_proj."
                             "weight"}),
            "model.language_model");
  EXPECT_EQ(AttentionPrefix({"lm_head.weight"}), "model");
}

}  // namespace
}  // namespace kvcal
