// The engine's operations as the communicator sees them, and what their signatures on
// the wire mean. The transport carries a collective's signature as opaque bytes and asks
// CollectiveRules whether a peer's matches ours and how to say it does not; the
// handshake's terms (the options that cut messages) travel the same way.
#pragma once
#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/options.h"
#include "algorithms/cost_model.h"
#include "transport/signature.h"

namespace mccl {

// What the communicator runs. The collectives' values are their names on the wire
// (inside the signature), so they never change.
enum class OpKind : uint16_t {
  kAllreduce = 1,
  kBroadcast = 2,
  kAllgather = 3,
  kReduceScatter = 4,
  kReduce = 5,
  kGather = 6,
  kScatter = 7,
  kAlltoall = 8,
  kAlltoallv = 9,
  kBarrier = 10,
  kP2P = 11,  // send/recv: never signed, matched per (peer, tag)
  kCalibrate = 12,  // measuring the cost model's parameters, once at start (calibrate.h)
};
const char* op_kind_name(OpKind k);

// One collective's signature, decoded. Fields that do not apply stay at their defaults.
struct OpSignature {
  OpKind kind = OpKind::kBarrier;
  // The algorithm it runs (algorithms/cost_model.h Algo; 0: no choice): ranks that chose
  // differently (another MCCL_ALGO or MCCL_ALPHA_US) fail at the first frame.
  uint8_t algo = 0;
  uint64_t op_bytes = 0;  // the op's size in bytes (0: not compared: alltoallv, barrier)
  uint8_t dtype = 0;      // element type of reducing ops
  uint8_t redop = 0;      // reduce op of reducing ops
  int32_t root = -1;      // root rank, -1 if none; an all-reduce run by switch: the grouping's fingerprint
  uint32_t pieces = 0;    // a ticketed op's pieces (algorithms/pieces.h); 0: not pipelined
};
Signature encode_signature(const OpSignature& s);
// Never throws: a peer's bytes decode to whatever they say; mismatch() judges them.
OpSignature decode_signature(const Signature& s);

// Options every rank must share because they decide how messages are cut.
Terms terms_of(const Options& opts);

class CollectiveRules : public SignatureRules {
 public:
  std::string name(const Signature& s) const override;
  std::string summary(const Signature& s) const override;
  std::string mismatch(const Signature& mine, const Signature& theirs, const std::string& who,
                       const std::string& opno) const override;
  std::string terms_mismatch(const Terms& dialer, const Terms& acceptor) const override;
};

}  // namespace mccl
