#include "transport/frame.h"

#include "core/errors.h"
#include "core/le.h"

namespace mccl {

namespace {

[[noreturn]] void bad_frame(const std::string& why, int peer_rank, const std::string& addr) {
  throw_error(ErrorKind::kProtocol,
              "[transport] malformed frame from peer=" + addr + " (rank " +
                  std::to_string(peer_rank) + "): " + why +
                  "; likely cause: a process that is not MCCL or a different MCCL version "
                  "is connected; restart all ranks with the same build",
              peer_rank, addr);
}

}  // namespace

const char* frame_kind_name(FrameKind k) {
  switch (k) {
    case FrameKind::kCollective: return "collective";
    case FrameKind::kP2P: return "send/recv";
    case FrameKind::kAbort: return "abort";
    case FrameKind::kBye: return "bye";
  }
  return "unknown";
}

static_assert(4 + 2 + 2 + 8 + 8 + 4 + 8 + 8 + 8 + kSignatureBytes == kFrameHeaderBytes,
              "encode_header writes exactly kFrameHeaderBytes");

void encode_header(const FrameHeader& h, uint8_t out[kFrameHeaderBytes]) {
  uint8_t* p = out;
  put_le<uint32_t>(p, h.magic);
  put_le<uint16_t>(p, h.version);
  put_le<uint16_t>(p, static_cast<uint16_t>(h.kind));
  put_le<uint64_t>(p, h.comm_id);
  put_le<uint64_t>(p, h.seq);
  put_le<uint32_t>(p, h.tag);
  put_le<uint64_t>(p, h.offset);
  put_le<uint64_t>(p, h.length);
  put_le<uint64_t>(p, h.total);
  for (uint8_t b : h.sig) *p++ = b;
}

FrameHeader decode_header(const uint8_t in[kFrameHeaderBytes]) {
  const uint8_t* p = in;
  FrameHeader h;
  h.magic = get_le<uint32_t>(p);
  h.version = get_le<uint16_t>(p);
  h.kind = static_cast<FrameKind>(get_le<uint16_t>(p));
  h.comm_id = get_le<uint64_t>(p);
  h.seq = get_le<uint64_t>(p);
  h.tag = get_le<uint32_t>(p);
  h.offset = get_le<uint64_t>(p);
  h.length = get_le<uint64_t>(p);
  h.total = get_le<uint64_t>(p);
  for (uint8_t& b : h.sig) b = *p++;
  return h;
}

void validate_header(const FrameHeader& h, uint64_t comm_id, int peer_rank,
                     const std::string& peer_addr) {
  if (h.magic != kFrameMagic) bad_frame("bad magic", peer_rank, peer_addr);
  if (h.version != kProtocolVersion) {
    bad_frame("protocol version " + std::to_string(h.version) + ", this rank speaks " +
                  std::to_string(kProtocolVersion),
              peer_rank, peer_addr);
  }
  if (h.comm_id != comm_id) {
    // Sockets are reused across communicators (daemon mode): say which one it came from.
    throw_error(ErrorKind::kProtocol,
                "[transport] stale frame from peer=" + peer_addr + " (rank " +
                    std::to_string(peer_rank) + "): it belongs to communicator " +
                    std::to_string(h.comm_id) + ", this socket now serves communicator " +
                    std::to_string(comm_id) +
                    "; likely cause: a process of an earlier job still writes to it; restart "
                    "that job's ranks and the jobs on this link",
                peer_rank, peer_addr);
  }
  auto k = static_cast<uint16_t>(h.kind);
  if (k < static_cast<uint16_t>(FrameKind::kCollective) || k > static_cast<uint16_t>(FrameKind::kBye)) {
    bad_frame("unknown frame kind " + std::to_string(k), peer_rank, peer_addr);
  }
  if (h.total > kMaxFrameBytes || h.length > h.total || h.offset > h.total - h.length) {
    bad_frame("payload range [" + std::to_string(h.offset) + ", +" + std::to_string(h.length) +
                  ") outside a message of " + std::to_string(h.total) + " bytes",
              peer_rank, peer_addr);
  }
  if (h.kind == FrameKind::kAbort && h.total > kMaxAbortPayload) {
    bad_frame("oversized abort frame", peer_rank, peer_addr);
  }
  if (h.kind == FrameKind::kBye && h.total != 0) bad_frame("bye frame with payload", peer_rank, peer_addr);
}

std::string encode_abort(const AbortInfo& a) {
  std::string addr = a.lost_addr.substr(0, 256);
  std::string msg = a.message.substr(0, kMaxAbortPayload - 512);
  std::string out(4 * 5 + addr.size() + msg.size(), '\0');
  auto* p = reinterpret_cast<uint8_t*>(&out[0]);
  put_le<uint32_t>(p, static_cast<uint32_t>(a.origin_rank));
  put_le<uint32_t>(p, static_cast<uint32_t>(a.lost_rank));
  put_le<uint32_t>(p, static_cast<uint32_t>(a.kind));
  put_le<uint32_t>(p, static_cast<uint32_t>(addr.size()));
  put_le<uint32_t>(p, static_cast<uint32_t>(msg.size()));
  std::copy(addr.begin(), addr.end(), p);
  std::copy(msg.begin(), msg.end(), p + addr.size());
  return out;
}

bool decode_abort(const uint8_t* p, size_t n, AbortInfo* out) {
  if (n < 20) return false;
  out->origin_rank = static_cast<int32_t>(get_le<uint32_t>(p));
  out->lost_rank = static_cast<int32_t>(get_le<uint32_t>(p));
  out->kind = static_cast<int32_t>(get_le<uint32_t>(p));
  uint32_t alen = get_le<uint32_t>(p);
  uint32_t mlen = get_le<uint32_t>(p);
  if (size_t(alen) + mlen != n - 20) return false;
  out->lost_addr.assign(reinterpret_cast<const char*>(p), alen);
  out->message.assign(reinterpret_cast<const char*>(p) + alen, mlen);
  return (out->kind >= 0 && out->kind <= static_cast<int32_t>(ErrorKind::kAborted)) ||
         out->kind == static_cast<int32_t>(ErrorKind::kAuth);
}

}  // namespace mccl
