// Scales for the client tests' demo checkpoints: one value per (layer,
// role) per tensor, one per head per head, each distinct, so that a test
// can tell which scale landed where.
#ifndef KVCAL_TESTS_CLIENT_TEST_SCALES_H_
#define KVCAL_TESTS_CLIENT_TEST_SCALES_H_

#include <cstdint>
#include <string>

#include "client/checkpoint/demo_model.h"
#include "client/checkpoint/scales_file.h"
#include "kernels/types.h"

namespace kvcal::testing {

// base × (1 + layer + 0.1·head + 0.01·role), under `observer`, with the
// metadata entry session = `session`.
inline CalibratedScales MakeScales(const DemoModelOptions& m,
                                   Granularity granularity, float base,
                                   const std::string& observer,
                                   const std::string& session) {
  CalibratedScales s;
  s.granularity = granularity;
  s.observer = observer;
  s.metadata["session"] = session;
  for (uint32_t l = 0; l < m.geometry.num_layers; ++l) {
    for (Role role : kAllRoles) {
      const uint32_t heads = role == Role::kQ ? m.geometry.num_attention_heads
                                              : m.geometry.num_key_value_heads;
      const uint32_t n = granularity == Granularity::kPerHead ? heads : 1;
      for (uint32_t h = 0; h < n; ++h) {
        s.layers[l][RoleIndex(role)].push_back(
            base * (1.0f + l + 0.1f * h + 0.01f * RoleIndex(role)));
      }
    }
  }
  return s;
}

}  // namespace kvcal::testing

#endif  // KVCAL_TESTS_CLIENT_TEST_SCALES_H_
