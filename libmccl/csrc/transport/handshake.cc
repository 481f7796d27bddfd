#include "transport/handshake.h"

#include <cstring>
#include <vector>

#include "core/errors.h"
#include "transport/frame.h"

namespace mccl {

namespace {

constexpr size_t kHelloBytes = 56;
constexpr size_t kReplyFixed = 12;
constexpr uint32_t kMaxReason = 1024;

void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
void put64(uint8_t* p, uint64_t v) {
  put32(p, static_cast<uint32_t>(v));
  put32(p + 4, static_cast<uint32_t>(v >> 32));
}
uint64_t get64(const uint8_t* p) { return uint64_t(get32(p)) | uint64_t(get32(p + 4)) << 32; }

void encode_hello(const Hello& h, uint8_t* out) {
  put32(out, kFrameMagic);
  put32(out + 4, kProtocolVersion);  // u16 version + u16 zero padding
  put64(out + 8, h.comm_id);
  put32(out + 16, h.from_rank);
  put32(out + 20, h.to_rank);
  put32(out + 24, h.world);
  put32(out + 28, h.sock_index);
  put32(out + 32, h.socks_per_peer);
  std::memcpy(out + 36, h.terms.data(), kTermsBytes);
  put32(out + 52, h.frame_mac);
}

// The refusal says what differs; `kind` decides the exception class on both sides.
struct Verdict {
  ErrorKind kind = ErrorKind::kGeneric;
  std::string reason;  // empty: accepted
};

Verdict judge(const Hello& theirs, uint32_t version, const Hello& mine,
              const SignatureRules& rules) {
  auto n = [](uint64_t v) { return std::to_string(v); };
  if (version != kProtocolVersion) {
    return {ErrorKind::kProtocol, "protocol version mismatch (dialer speaks " + n(version) +
                                      ", acceptor " + n(kProtocolVersion) +
                                      "); run the same MCCL build on every rank"};
  }
  if (theirs.comm_id != mine.comm_id) {
    return {ErrorKind::kProtocol,
            "communicator id mismatch (dialer " + n(theirs.comm_id) + ", acceptor " +
                n(mine.comm_id) +
                "); likely a stale process from an earlier job; restart all ranks"};
  }
  if (theirs.world != mine.world) {
    return {ErrorKind::kConfig, "world size mismatch (dialer " + n(theirs.world) +
                                    ", acceptor " + n(mine.world) +
                                    "); every rank must be started with the same world size"};
  }
  if (theirs.to_rank != mine.from_rank) {
    return {ErrorKind::kConfig, "dialer wanted rank " + n(theirs.to_rank) + " but reached rank " +
                                    n(mine.from_rank) +
                                    "; the ranks disagree on the peer address list"};
  }
  if (theirs.from_rank >= mine.from_rank) {
    return {ErrorKind::kConfig, "rank " + n(theirs.from_rank) + " dialed rank " +
                                    n(mine.from_rank) +
                                    " but only lower ranks dial; duplicate or misnumbered rank"};
  }
  if (theirs.socks_per_peer != mine.socks_per_peer || theirs.sock_index >= mine.socks_per_peer) {
    return {ErrorKind::kConfig, "sockets per peer mismatch (dialer " + n(theirs.socks_per_peer) +
                                    ", acceptor " + n(mine.socks_per_peer) +
                                    "); set MCCL_SOCKETS_PER_PEER the same on every rank"};
  }
  // Typically how the algorithms cut messages: ranks that disagree would post receives
  // that never match (a hang until the timeout) instead of failing now.
  if (theirs.terms != mine.terms) {
    std::string why = rules.terms_mismatch(theirs.terms, mine.terms);
    return {ErrorKind::kConfig, why.empty() ? "the ranks' options differ" : why};
  }
  if (theirs.frame_mac != mine.frame_mac) {
    auto on = [](uint32_t v) { return std::string(v ? "on" : "off"); };
    return {ErrorKind::kConfig, "frame MAC mismatch (dialer " + on(theirs.frame_mac) + ", acceptor " +
                                    on(mine.frame_mac) +
                                    "); set MCCL_FRAME_MAC the same on every mccld of the fleet"};
  }
  return {};
}

}  // namespace

bool handshake_dial(int fd, const Hello& hello, const std::string& peer_addr, Deadline deadline,
                    const std::atomic<bool>* cancel) {
  const int peer = static_cast<int>(hello.to_rank);
  const std::string who = "peer=" + peer_addr + " (rank " + std::to_string(peer) + ")";
  uint8_t buf[kHelloBytes];
  encode_hello(hello, buf);
  uint8_t reply[kReplyFixed];
  if (!write_all(fd, buf, sizeof(buf), deadline, cancel) ||
      !read_all(fd, reply, sizeof(reply), deadline, cancel)) {
    if (cancel && cancel->load()) return false;
    throw_error(ErrorKind::kPeerLost,
                "[transport] handshake with " + who +
                    " got no answer; likely cause: that rank exited, or the address belongs to "
                    "another program; check every rank is running the same job",
                peer, peer_addr);
  }
  uint32_t status = get32(reply + 4);
  uint32_t len = get32(reply + 8);
  if (get32(reply) != kFrameMagic || len > kMaxReason || status > 6) {
    throw_error(ErrorKind::kProtocol,
                "[transport] handshake with " + who +
                    ": the answer is not MCCL; the address belongs to another program",
                peer, peer_addr);
  }
  if (status == 0) return true;
  std::string reason(len, '\0');
  if (len && !read_all(fd, &reason[0], len, deadline)) reason = "(reason lost)";
  throw_error(static_cast<ErrorKind>(status),
              "[transport] handshake refused by " + who + ": " + reason, peer, peer_addr);
}

std::optional<Hello> handshake_accept_impl(int fd, const Hello& mine, const SignatureRules& rules,
                                           Deadline deadline,
                                           bool (*is_dup)(void*, uint32_t, uint32_t),
                                           void* ctx) {
  uint8_t buf[kHelloBytes];
  if (!read_all(fd, buf, sizeof(buf), deadline) || get32(buf) != kFrameMagic) {
    return std::nullopt;  // not one of ours (port scanner, health check): drop it
  }
  Hello theirs;
  uint32_t version = get32(buf + 4) & 0xFFFF;
  theirs.comm_id = get64(buf + 8);
  theirs.from_rank = get32(buf + 16);
  theirs.to_rank = get32(buf + 20);
  theirs.world = get32(buf + 24);
  theirs.sock_index = get32(buf + 28);
  theirs.socks_per_peer = get32(buf + 32);
  std::memcpy(theirs.terms.data(), buf + 36, kTermsBytes);
  theirs.frame_mac = get32(buf + 52);

  Verdict v = judge(theirs, version, mine, rules);
  if (v.reason.empty() && is_dup(ctx, theirs.from_rank, theirs.sock_index)) {
    v = {ErrorKind::kConfig, "two processes claim rank " + std::to_string(theirs.from_rank) +
                                 "; a stale process from an earlier job or a misnumbered rank"};
  }
  std::vector<uint8_t> reply(kReplyFixed + v.reason.size());
  put32(reply.data(), kFrameMagic);
  put32(reply.data() + 4, v.reason.empty() ? 0 : static_cast<uint32_t>(v.kind));
  put32(reply.data() + 8, static_cast<uint32_t>(v.reason.size()));
  std::memcpy(reply.data() + kReplyFixed, v.reason.data(), v.reason.size());
  bool sent = write_all(fd, reply.data(), reply.size(), deadline);
  if (!v.reason.empty()) {
    std::string addr = remote_address(fd);
    throw_error(v.kind,
                "[transport] refused a handshake from peer=" + addr + " (claims rank " +
                    std::to_string(theirs.from_rank) + "): " + v.reason,
                static_cast<int>(theirs.from_rank), addr);
  }
  if (!sent) return std::nullopt;
  return theirs;
}

}  // namespace mccl
