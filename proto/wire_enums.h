// The engine's enums (kernels/types.h, kernels/scale_math.h) carry the
// wire's numbers (kvcal.v1's Role, DType, Layout, Observer, Granularity,
// Format): checked here once, at compile time (Observer by a test, below),
// and converted only through
// ToWire / FromWire, by the service (proto_convert) and the client alike.
//
//   request.set_role(kvcal::ToWire(chunk.role));
//   kvcal::Format format = kvcal::FromWire(request.format());
#ifndef KVCAL_PROTO_WIRE_ENUMS_H_
#define KVCAL_PROTO_WIRE_ENUMS_H_

#include "kernels/scale_math.h"
#include "kernels/types.h"
#include "kvcal/v1/calibration.pb.h"

namespace kvcal {
namespace wire_enums_internal {

template <typename Engine, typename Wire>
constexpr bool Same(Engine e, Wire w) {
  return static_cast<int>(e) == static_cast<int>(w);
}

static_assert(Same(Role::kQ, v1::ROLE_Q) && Same(Role::kK, v1::ROLE_K) &&
              Same(Role::kV, v1::ROLE_V) && v1::Role_MAX == v1::ROLE_V);
static_assert(Same(DType::kF32, v1::DTYPE_F32) &&
              Same(DType::kF16, v1::DTYPE_F16) &&
              Same(DType::kBf16, v1::DTYPE_BF16) &&
              v1::DType_MAX == v1::DTYPE_BF16);
static_assert(Same(Layout::kTokensHeadsDim, v1::LAYOUT_TOKENS_HEADS_DIM) &&
              Same(Layout::kHeadsTokensDim, v1::LAYOUT_HEADS_TOKENS_DIM) &&
              v1::Layout_MAX == v1::LAYOUT_HEADS_TOKENS_DIM);
static_assert(Same(Granularity::kPerTensor, v1::GRANULARITY_PER_TENSOR) &&
              Same(Granularity::kPerHead, v1::GRANULARITY_PER_HEAD) &&
              v1::Granularity_MAX == v1::GRANULARITY_PER_HEAD);
// Observer: the engine's definitions (kernels/observers/) against the proto's
// table, by number, name and needs_histograms, in
// tests/service/observer_table_test.cc.
static_assert(Same(Format::kFp8E4m3fn, v1::FORMAT_FP8_E4M3FN) &&
              Same(Format::kFp8E4m3fnuz, v1::FORMAT_FP8_E4M3FNUZ) &&
              Same(Format::kFp8E5m2, v1::FORMAT_FP8_E5M2) &&
              Same(Format::kInt8, v1::FORMAT_INT8) &&
              v1::Format_MAX == v1::FORMAT_INT8);

}  // namespace wire_enums_internal

inline v1::Role ToWire(Role e) { return static_cast<v1::Role>(e); }
inline v1::DType ToWire(DType e) { return static_cast<v1::DType>(e); }
inline v1::Layout ToWire(Layout e) { return static_cast<v1::Layout>(e); }
inline v1::Observer ToWire(Observer e) { return static_cast<v1::Observer>(e); }
inline v1::Granularity ToWire(Granularity e) {
  return static_cast<v1::Granularity>(e);
}
inline v1::Format ToWire(Format e) { return static_cast<v1::Format>(e); }

// The wire value must be one the engine has (the service validates requests
// first; OBSERVER_AUTO, for one, is not).
inline Role FromWire(v1::Role w) { return static_cast<Role>(w); }
inline DType FromWire(v1::DType w) { return static_cast<DType>(w); }
inline Layout FromWire(v1::Layout w) { return static_cast<Layout>(w); }
inline Observer FromWire(v1::Observer w) { return static_cast<Observer>(w); }
inline Granularity FromWire(v1::Granularity w) {
  return static_cast<Granularity>(w);
}
inline Format FromWire(v1::Format w) { return static_cast<Format>(w); }

}  // namespace kvcal

#endif  // KVCAL_PROTO_WIRE_ENUMS_H_
