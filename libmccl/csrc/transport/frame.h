// The wire header that precedes every payload on a link socket. Fixed size,
// little-endian, encoded field by field (never memcpy of a struct) so that Linux and
// macOS peers agree regardless of compiler padding.
//
// Beyond the fields of a plain (seq, tag, offset, length) header it carries the
// *signature* of the collective the sender is running (op_bytes, dtype, reduce op,
// root). The receiver compares it with its own op of the same sequence number as soon
// as the first frame arrives, so ranks that disagree on a collective's size or kind fail
// at once with CollectiveMismatch instead of waiting for a frame that never matches.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace mccl {

constexpr uint32_t kFrameMagic = 0x4C43434D;  // "MCCL" read as little-endian bytes
constexpr uint16_t kProtocolVersion = 1;
constexpr size_t kFrameHeaderBytes = 72;
// One frame never carries more than this; larger messages are split by the sender.
constexpr uint64_t kMaxFrameBytes = uint64_t(1) << 40;

// What a frame belongs to. Collective kinds double as the op's name in messages.
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
  kP2P = 11,     // send/recv: matched per (peer, tag) sequence numbers
  kAbort = 12,   // control: a rank failed; payload = AbortInfo
  kBye = 13,     // control: orderly shutdown; the following EOF is not a failure
};
const char* op_kind_name(OpKind k);
bool op_kind_is_collective(OpKind k);

struct FrameHeader {
  uint32_t magic = kFrameMagic;
  uint16_t version = kProtocolVersion;
  OpKind kind = OpKind::kP2P;
  uint64_t comm_id = 0;
  uint64_t seq = 0;      // collective sequence number, or p2p per-(peer, tag) number
  uint32_t tag = 0;      // collective: step/segment id; p2p: the user's tag
  uint32_t flags = 0;    // collective signature: pieces of a pipelined op (0: not pipelined)
  uint64_t offset = 0;   // where this frame's payload goes inside the message
  uint64_t length = 0;   // payload bytes of this frame
  uint64_t total = 0;    // bytes of the whole message (all stripes)
  uint64_t op_bytes = 0; // collective signature: the op's size in bytes (0: not compared)
  uint8_t dtype = 0;     // collective signature: element type
  uint8_t redop = 0;     // collective signature: reduce op
  uint16_t reserved = 0;
  int32_t root = -1;     // collective signature: root rank, -1 if none
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
