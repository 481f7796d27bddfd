#include "transport/handshake.h"

#include <cstring>
#include <vector>

#include "core/errors.h"
#include "core/options.h"
#include "transport/frame.h"

namespace mccl {

namespace {

// The handshake's own version, apart from the frames' kProtocolVersion: v3 is the first
// keyed one.
constexpr uint32_t kLinkVersion = 3;
constexpr size_t kHelloBytes = 88;
constexpr size_t kReplyBytes = 44;  // magic, status, reason length, nonce or proof
constexpr size_t kProofMsgBytes = 4 + kLinkProofBytes;
constexpr uint32_t kMaxReason = 1024;

// Labels keep the two proofs and the two key directions apart under one secret.
constexpr char kDialLabel[] = "mccl link v3 dialer proof";
constexpr char kAcceptLabel[] = "mccl link v3 acceptor proof";
constexpr char kKeyD2A[] = "mccl link v3 frames dialer->acceptor";
constexpr char kKeyA2D[] = "mccl link v3 frames acceptor->dialer";

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

void encode_hello(const Hello& h, const uint8_t nonce[kLinkNonceBytes], uint8_t* out) {
  put32(out, kFrameMagic);
  put32(out + 4, kLinkVersion);
  put64(out + 8, h.comm_id);
  put32(out + 16, h.from_rank);
  put32(out + 20, h.to_rank);
  put32(out + 24, h.world);
  put32(out + 28, h.sock_index);
  put32(out + 32, h.socks_per_peer);
  std::memcpy(out + 36, h.terms.data(), kTermsBytes);
  put32(out + 52, h.wire_security);
  std::memcpy(out + 56, nonce, kLinkNonceBytes);
}

Hello decode_hello(const uint8_t* in) {
  Hello h;
  h.comm_id = get64(in + 8);
  h.from_rank = get32(in + 16);
  h.to_rank = get32(in + 20);
  h.world = get32(in + 24);
  h.sock_index = get32(in + 28);
  h.socks_per_peer = get32(in + 32);
  std::memcpy(h.terms.data(), in + 36, kTermsBytes);
  h.wire_security = get32(in + 52);
  return h;
}

const uint8_t* nonce_of_hello(const uint8_t* hello) { return hello + 56; }

const char* mode_name(uint32_t m) {
  switch (m) {
    case static_cast<uint32_t>(WireSecurity::kOff): return "off";
    case static_cast<uint32_t>(WireSecurity::kMac): return "mac";
    case static_cast<uint32_t>(WireSecurity::kAead): return "aead";
    default: return "unknown";
  }
}

bool keyed(uint32_t mode) { return mode != static_cast<uint32_t>(WireSecurity::kOff); }

// Both proofs cover the whole transcript; the acceptor's also covers its verdict, so a
// stranger on the path can neither forge an "ok" nor turn one into a refusal.
void dialer_proof(const LinkSecret& s, const uint8_t* hello, const uint8_t* na, uint8_t* out) {
  hmac_sha256(s, {{kDialLabel, sizeof(kDialLabel)}, {hello, kHelloBytes}, {na, kLinkNonceBytes}},
              out);
}

void acceptor_proof(const LinkSecret& s, const uint8_t* hello, const uint8_t* na,
                    const uint8_t* status_and_len, const std::string& reason, uint8_t* out) {
  hmac_sha256(s,
              {{kAcceptLabel, sizeof(kAcceptLabel)},
               {hello, kHelloBytes},
               {na, kLinkNonceBytes},
               {status_and_len, 8},
               {reason.data(), reason.size()}},
              out);
}

FrameKeys derive_keys(const LinkSecret& s, const uint8_t* hello, const uint8_t* na,
                      bool dialer) {
  uint8_t salt[2 * kLinkNonceBytes];
  std::memcpy(salt, nonce_of_hello(hello), kLinkNonceBytes);
  std::memcpy(salt + kLinkNonceBytes, na, kLinkNonceBytes);
  auto info = [&](const char* label, size_t n) {
    std::vector<uint8_t> v(label, label + n);
    v.insert(v.end(), hello, hello + kHelloBytes);
    v.insert(v.end(), na, na + kLinkNonceBytes);
    return v;
  };
  std::vector<uint8_t> d2a = info(kKeyD2A, sizeof(kKeyD2A));
  std::vector<uint8_t> a2d = info(kKeyA2D, sizeof(kKeyA2D));
  FrameKeys k;
  hkdf_sha256(s, {salt, sizeof(salt)}, {d2a.data(), d2a.size()}, dialer ? k.send : k.recv,
              kMacKeyBytes);
  hkdf_sha256(s, {salt, sizeof(salt)}, {a2d.data(), a2d.size()}, dialer ? k.recv : k.send,
              kMacKeyBytes);
  return k;
}

// The refusal says what differs; `kind` decides the exception class on both sides. Only
// for a peer that proved the key: it may learn this rank's view, except the comm id,
// which would let it pose as a member of this communicator elsewhere.
struct Verdict {
  ErrorKind kind = ErrorKind::kGeneric;
  std::string reason;  // empty: accepted
};

Verdict judge(const Hello& theirs, const Hello& mine, const SignatureRules& rules) {
  auto n = [](uint64_t v) { return std::to_string(v); };
  if (theirs.comm_id != mine.comm_id) {
    return {ErrorKind::kProtocol,
            "communicator id mismatch; likely a stale process from an earlier job of the same "
            "job key; restart all ranks"};
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
  if (theirs.from_rank >= mine.world || theirs.from_rank == mine.from_rank) {
    return {ErrorKind::kConfig, "rank " + n(theirs.from_rank) + " dialed rank " +
                                    n(mine.from_rank) + " in a world of " + n(mine.world) +
                                    "; duplicate or misnumbered rank"};
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
  if (theirs.wire_security != mine.wire_security) {
    return {ErrorKind::kConfig, std::string("wire security mismatch (dialer ") +
                                    mode_name(theirs.wire_security) + ", acceptor " +
                                    mode_name(mine.wire_security) +
                                    "); set MCCL_WIRE_SECURITY the same on every rank and mccld"};
  }
  return {};
}

void encode_reply(uint8_t* out, uint32_t status, uint32_t reason_len, const uint8_t* tail32) {
  put32(out, kFrameMagic);
  put32(out + 4, status);
  put32(out + 8, reason_len);
  std::memcpy(out + 12, tail32, 32);
}

bool send_reply(int fd, uint32_t status, const uint8_t* tail32, const std::string& reason,
                Deadline deadline, const std::atomic<bool>* cancel) {
  std::vector<uint8_t> msg(kReplyBytes + reason.size());
  encode_reply(msg.data(), status, static_cast<uint32_t>(reason.size()), tail32);
  std::memcpy(msg.data() + kReplyBytes, reason.data(), reason.size());
  return write_all(fd, msg.data(), msg.size(), deadline, cancel);
}

}  // namespace

bool handshake_dial(int fd, const Hello& hello, const LinkSecret& secret,
                    const std::string& peer_addr, Deadline deadline,
                    const std::atomic<bool>* cancel, FrameKeys* keys, bool* declined,
                    bool* closed_early) {
  const int peer = static_cast<int>(hello.to_rank);
  const std::string who = "peer=" + peer_addr + " (rank " + std::to_string(peer) + ")";
  const bool with_key = keyed(hello.wire_security);
  const std::string key_cause =
      "likely cause: the ranks hold different job keys (MCCL_JOB_KEY_FILE / the fleet key), or "
      "another program holds that address; give every rank of the job the same key";

  uint8_t nd[kLinkNonceBytes];
  random_bytes(nd, sizeof(nd));
  uint8_t hello_buf[kHelloBytes];
  encode_hello(hello, nd, hello_buf);
  uint8_t reply[kReplyBytes];
  auto read_reason = [&](uint32_t len) {
    std::string reason(len, '\0');
    if (len && !read_all(fd, &reason[0], len, deadline, cancel)) reason = "(reason lost)";
    return reason;
  };
  // Before the acceptor proved the key its words are a stranger's: keep them printable so
  // they cannot forge log lines.
  auto printable = [](std::string text) {
    for (char& c : text) {
      if (c < 0x20 || c > 0x7e) c = '?';
    }
    return text;
  };
  auto malformed = [&](const uint8_t* r) {
    return get32(r) != kFrameMagic || get32(r + 8) > kMaxReason ||
           (get32(r + 4) > static_cast<uint32_t>(ErrorKind::kAuth) &&
            get32(r + 4) != kDeclinedStatus);
  };

  if (!write_all(fd, hello_buf, sizeof(hello_buf), deadline, cancel) ||
      !read_all(fd, reply, sizeof(reply), deadline, cancel)) {
    if (cancel && cancel->load()) return false;
    if (closed_early && Clock::now() < deadline) {
      // Closed or reset before its challenge, not silent until the deadline: a listener
      // full of strangers' connections drops its oldest; the caller dials again.
      *closed_early = true;
      return false;
    }
    throw_error(ErrorKind::kPeerLost,
                "[transport] handshake with " + who +
                    " got no answer; likely cause: that rank exited, or the address belongs to "
                    "another program; check every rank is running the same job",
                peer, peer_addr);
  }
  if (malformed(reply)) {
    throw_error(ErrorKind::kProtocol,
                "[transport] handshake with " + who +
                    ": the answer is not MCCL; the address belongs to another program",
                peer, peer_addr);
  }
  if (get32(reply + 4) != 0) {
    // Before any proof: only a different build or an off/on mode is refused in words.
    const uint32_t status = get32(reply + 4);
    std::string reason = printable(read_reason(get32(reply + 8)));
    const bool expected = status == static_cast<uint32_t>(ErrorKind::kProtocol) ||
                          status == static_cast<uint32_t>(ErrorKind::kConfig);
    throw_error(expected ? static_cast<ErrorKind>(status) : ErrorKind::kProtocol,
                "[transport] handshake refused by " + who +
                    " before the key exchange (unauthenticated): " + reason,
                peer, peer_addr);
  }
  uint8_t na[kLinkNonceBytes];
  std::memcpy(na, reply + 12, kLinkNonceBytes);

  uint8_t proof[kProofMsgBytes] = {};
  put32(proof, kFrameMagic);
  if (with_key) dialer_proof(secret, hello_buf, na, proof + 4);
  if (!write_all(fd, proof, sizeof(proof), deadline, cancel) ||
      !read_all(fd, reply, sizeof(reply), deadline, cancel)) {
    if (cancel && cancel->load()) return false;
    if (with_key) {
      throw_error(ErrorKind::kAuth,
                  "[transport] " + who + " dropped the link after our proof of the job key; " +
                      key_cause,
                  peer, peer_addr);
    }
    throw_error(ErrorKind::kPeerLost,
                "[transport] handshake with " + who + " got no verdict; likely cause: that rank "
                "exited or refused us; check its log",
                peer, peer_addr);
  }
  if (malformed(reply)) {
    throw_error(ErrorKind::kProtocol,
                "[transport] handshake with " + who +
                    ": the verdict is not MCCL; the address belongs to another program",
                peer, peer_addr);
  }
  const uint32_t status = get32(reply + 4);
  std::string reason = read_reason(get32(reply + 8));
  if (with_key) {
    uint8_t want[kLinkProofBytes];
    acceptor_proof(secret, hello_buf, na, reply + 4, reason, want);
    const bool ok = equal_secret(want, reply + 12, kLinkProofBytes);
    wipe(want, sizeof(want));
    if (!ok) {
      throw_error(ErrorKind::kAuth,
                  "[transport] " + who + " answered without proving the job key; " + key_cause,
                  peer, peer_addr);
    }
  }
  if (status == kDeclinedStatus && declined) {
    *declined = true;  // proved by the acceptor: it dials this link itself (linker.h)
    return false;
  }
  if (status != 0) {
    throw_error(status == kDeclinedStatus ? ErrorKind::kProtocol : static_cast<ErrorKind>(status),
                "[transport] handshake refused by " + who + ": " + reason, peer, peer_addr);
  }
  if (with_key) *keys = derive_keys(secret, hello_buf, na, /*dialer=*/true);
  return true;
}

AcceptSteps::~AcceptSteps() {
  wipe(na_, sizeof(na_));
}

std::string AcceptSteps::on_hello(const uint8_t* hello, std::string* dropped_why) {
  static_assert(kHelloBytes == mccl::kHelloBytes && kProofBytes == kProofMsgBytes, "sizes");
  auto reply = [](uint32_t status, const uint8_t* tail32, const std::string& reason) {
    std::string msg(kReplyBytes + reason.size(), '\0');
    encode_reply(reinterpret_cast<uint8_t*>(&msg[0]), status,
                 static_cast<uint32_t>(reason.size()), tail32);
    std::memcpy(&msg[kReplyBytes], reason.data(), reason.size());
    return msg;
  };
  std::memcpy(hello_, hello, kHelloBytes);
  if (get32(hello_) != kFrameMagic) {
    *dropped_why = "is not an MCCL link (no MCCL hello)";
    return {};
  }
  const uint8_t zeros[32] = {};
  if (get32(hello_ + 4) != kLinkVersion) {
    // Facts about this build only: nothing a stranger could use.
    *dropped_why = "speaks another link handshake version (another MCCL build)";
    return reply(static_cast<uint32_t>(ErrorKind::kProtocol), zeros,
                 "link handshake version mismatch (this rank speaks v" +
                     std::to_string(kLinkVersion) + "); run the same MCCL build on every rank");
  }
  theirs_ = decode_hello(hello_);
  if (keyed(theirs_.wire_security) != keyed(mine_.wire_security)) {
    // Without a key on both sides there is nothing to prove: say why instead of a silent drop.
    *dropped_why = std::string("asked for MCCL_WIRE_SECURITY=") +
                   mode_name(theirs_.wire_security) + " (this rank: " +
                   mode_name(mine_.wire_security) + ")";
    return reply(static_cast<uint32_t>(ErrorKind::kConfig), zeros,
                 std::string("wire security mismatch: this rank runs MCCL_WIRE_SECURITY=") +
                     mode_name(mine_.wire_security) +
                     "; set MCCL_WIRE_SECURITY the same on every rank and mccld");
  }
  dropped_why->clear();
  random_bytes(na_, sizeof(na_));
  return reply(0, na_, "");
}

std::optional<Accepted> AcceptSteps::on_proof(int fd, const uint8_t* proof, Deadline deadline,
                                              int (*slot)(void*, uint32_t, uint32_t), void* ctx,
                                              std::string* dropped_why,
                                              const std::atomic<bool>* cancel) {
  auto drop = [&](const std::string& why) -> std::optional<Accepted> {
    if (dropped_why) *dropped_why = why;
    return std::nullopt;
  };
  if (get32(proof) != kFrameMagic) return drop("sent no proof of the job key");
  const bool with_key = keyed(mine_.wire_security);
  if (with_key) {
    uint8_t want[kLinkProofBytes];
    dialer_proof(secret_, hello_, na_, want);
    const bool ok = equal_secret(want, proof + 4, kLinkProofBytes);
    wipe(want, sizeof(want));
    if (!ok) return drop(kFailedProofWhy);
  }

  // From here the peer holds the key: a disagreement is a misconfigured job, told in words.
  Verdict v = judge(theirs_, mine_, rules_);
  bool decline = false;
  if (v.reason.empty()) {
    const int taken = slot(ctx, theirs_.from_rank, theirs_.sock_index);
    if (taken == kSlotDecline) {
      decline = true;
      v.reason = "declined: this rank dials the link itself";
    } else if (taken != kSlotTake) {
      v = {ErrorKind::kConfig, "two processes claim rank " + std::to_string(theirs_.from_rank) +
                                   "; a stale process from an earlier job or a misnumbered rank"};
    }
  }
  if (v.reason.size() > kMaxReason) v.reason.resize(kMaxReason);
  const uint32_t status =
      decline ? kDeclinedStatus : v.reason.empty() ? 0 : static_cast<uint32_t>(v.kind);
  uint8_t status_and_len[8];
  put32(status_and_len, status);
  put32(status_and_len + 4, static_cast<uint32_t>(v.reason.size()));
  uint8_t tag[kLinkProofBytes] = {};
  if (with_key) acceptor_proof(secret_, hello_, na_, status_and_len, v.reason, tag);
  bool sent = send_reply(fd, status, tag, v.reason, deadline, cancel);
  if (decline) return drop(kDeclinedWhy);
  if (!v.reason.empty()) {
    std::string addr = remote_address(fd);
    throw_error(v.kind,
                "[transport] refused a handshake from peer=" + addr + " (rank " +
                    std::to_string(theirs_.from_rank) + ", proved the job key): " + v.reason,
                static_cast<int>(theirs_.from_rank), addr);
  }
  if (!sent) return drop("closed the link before the verdict");
  Accepted out;
  out.hello = theirs_;
  if (with_key) out.keys = derive_keys(secret_, hello_, na_, /*dialer=*/false);
  return out;
}

std::optional<Accepted> handshake_accept_impl(int fd, const Hello& mine, const LinkSecret& secret,
                                              const SignatureRules& rules, Deadline deadline,
                                              int (*slot)(void*, uint32_t, uint32_t),
                                              void* ctx, std::string* dropped_why,
                                              const std::atomic<bool>* cancel) {
  auto drop = [&](const std::string& why) -> std::optional<Accepted> {
    if (dropped_why) *dropped_why = why;
    return std::nullopt;
  };
  AcceptSteps steps(mine, secret, rules);
  uint8_t hello_buf[kHelloBytes];
  if (!read_all(fd, hello_buf, sizeof(hello_buf), deadline, cancel)) {
    return drop("sent no complete MCCL hello in time");
  }
  std::string why;
  const std::string answer = steps.on_hello(hello_buf, &why);
  if (!answer.empty() && !write_all(fd, answer.data(), answer.size(), deadline, cancel) &&
      why.empty()) {
    return drop("closed the link before the challenge");
  }
  if (!why.empty()) return drop(why);
  uint8_t proof[kProofMsgBytes];
  if (!read_all(fd, proof, sizeof(proof), deadline, cancel)) {
    return drop("sent no proof of the job key");
  }
  return steps.on_proof(fd, proof, deadline, slot, ctx, dropped_why, cancel);
}

}  // namespace mccl
