// The engine's Geometry of a kvcal.v1 message that carries one
// (CreateSessionRequest, Session, SessionState: num_layers,
// num_attention_heads, num_key_value_heads, head_dim,
// histogram_bins_per_octave, roles), for the service and the client alike.
//
//   KVCAL_ASSIGN_OR_RETURN(kvcal::Geometry g, kvcal::GeometryFromWire(session));
//
// Only the roles are checked here (Geometry::Validate() checks the rest).
#ifndef KVCAL_PROTO_WIRE_GEOMETRY_H_
#define KVCAL_PROTO_WIRE_GEOMETRY_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/types.h"
#include "kvcal/v1/calibration.pb.h"

namespace kvcal {

// Bit RoleIndex(r) per listed role; no roles = Q, K and V. InvalidArgument
// for ROLE_UNSPECIFIED or an unknown number.
inline absl::StatusOr<uint32_t> RoleMaskFromWire(
    const google::protobuf::RepeatedField<int>& roles) {
  if (roles.empty()) return 0b111u;
  uint32_t mask = 0;
  for (int role : roles) {
    if (role < v1::ROLE_Q || role > v1::ROLE_V) {
      return absl::InvalidArgumentError(
          absl::StrCat("roles contains ", role,
                       (role == 0 ? " (ROLE_UNSPECIFIED)" : " (unknown)"),
                       "; use ROLE_Q, ROLE_K or ROLE_V"));
    }
    mask |= 1u << RoleIndex(static_cast<Role>(role));
  }
  return mask;
}

template <typename Message>
absl::StatusOr<Geometry> GeometryFromWire(const Message& m) {
  Geometry g;
  g.num_layers = m.num_layers();
  g.num_attention_heads = m.num_attention_heads();
  g.num_key_value_heads = m.num_key_value_heads();
  g.head_dim = m.head_dim();
  g.bins_per_octave = m.histogram_bins_per_octave();
  absl::StatusOr<uint32_t> mask = RoleMaskFromWire(m.roles());
  if (!mask.ok()) return mask.status();
  g.role_mask = *mask;
  return g;
}

}  // namespace kvcal

#endif  // KVCAL_PROTO_WIRE_GEOMETRY_H_
