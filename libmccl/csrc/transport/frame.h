// The wire header that precedes every payload on a link socket. Fixed size,
// little-endian, encoded field by field (never memcpy of a struct) so that Linux and
// macOS peers agree regardless of compiler padding.
//
// Beyond the fields of a plain (seq, tag, offset, length) header a collective frame
// carries its op's signature: opaque bytes the transport compares through the rules of
// the layer above (signature.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/signature.h"

namespace mccl {

constexpr uint32_t kFrameMagic = 0x4C43434D;  // "MCCL" read as little-endian bytes
// 2: the collective's kind, size, dtype, op and root moved into the opaque signature.
constexpr uint16_t kProtocolVersion = 2;
constexpr size_t kFrameHeaderBytes = 72;
// One frame never carries more than this; larger messages are split by the sender.
constexpr uint64_t kMaxFrameBytes = uint64_t(1) << 40;

// Which stream a frame belongs to.
enum class FrameKind : uint16_t {
  kCollective = 1,  // matched per (collective seq, tag); carries the op's signature
  kP2P = 2,         // send/recv: matched per (peer, tag) sequence numbers
  kAbort = 3,       // control: a rank failed; payload = AbortInfo
  kBye = 4,         // control: orderly shutdown; the following EOF is not a failure
};
const char* frame_kind_name(FrameKind k);

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kProtocolVersion;
  FrameKind kind = FrameKind::kP2P;
  uint64_t comm_id = 0;
  uint64_t seq = 0;      // collective sequence number, or p2p per-(peer, tag) number
  uint32_t tag = 0;      // collective: step/segment id; p2p: the user's tag
  uint64_t offset = 0;   // where this frame's payload goes inside the message
  uint64_t length = 0;   // payload bytes of this frame
  uint64_t total = 0;    // bytes of the whole message (all stripes)
  Signature sig{};       // collective: the op's signature; zero otherwise
};

void encode_header(const FrameHeader& h, uint8_t out[kFrameHeaderBytes]);
FrameHeader decode_header(const uint8_t in[kFrameHeaderBytes]);

// Throws ProtocolError naming the peer if the frame is malformed or belongs to another
// communicator/protocol version.
void validate_header(const FrameHeader& h, uint64_t comm_id, int peer_rank,
                     const std::string& peer_addr);

// Payload of an ABORT frame: who failed, which peer it blames and why.
struct AbortInfo {
  int32_t origin_rank = -1;
  int32_t lost_rank = -1;
  int32_t kind = 0;  // mccl::ErrorKind
  std::string lost_addr;
  std::string message;
};
std::string encode_abort(const AbortInfo& a);
// Returns false if the payload is malformed.
bool decode_abort(const uint8_t* p, size_t n, AbortInfo* out);
constexpr size_t kMaxAbortPayload = 8192;

}  // namespace mccl
