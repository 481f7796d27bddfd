// The first bytes on every new link socket: a challenge-response on the job secret in
// which the dialer (the rank that needs the link, linker.h; the lower rank on handed-in
// sockets, mesh.h) proves the key first, then the acceptor proves it back along with its
// verdict, and both derive the socket's frame keys.
//
//   D -> A  hello     magic, version, comm id, ranks, world, socket index, sockets per
//                     peer, terms, wire security mode, fresh nonce nD      (88 bytes)
//   A -> D  challenge magic, status 0, fresh nonce nA                      (44 bytes)
//   D -> A  proof     magic, HMAC(secret, "dial" label, hello, nA)         (36 bytes)
//   A -> D  verdict   magic, status, HMAC(secret, "accept" label, hello, nA, status,
//                     reason), reason                                      (44 bytes + reason)
//
// The transcript (hello || nA) holds everything both sides rely on, so a proof binds them.
// Frame keys: HKDF-SHA256(secret, salt nD || nA, info = direction label || transcript);
// both nonces are fresh per handshake, so no key repeats across sockets, jobs or a pooled
// socket's next job. Until the dialer's proof checks out the acceptor tells it nothing
// about its own view (no comm id, no expected value): a connection that is not an MCCL
// hello or fails the proof is dropped, and the caller keeps accepting. Only the build and
// the off/on mode are refused in words before a proof, since without a shared key on both
// sides no proof can be made. Under WireSecurity::kOff no key exists: the proofs are sent
// as zeros and not checked, and no frame keys are derived.
#pragma once
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "integrity/keys.h"
#include "integrity/link_crypto.h"
#include "transport/signature.h"
#include "transport/socket.h"

namespace mccl {

struct Hello {
  uint64_t comm_id = 0;
  uint32_t from_rank = 0;
  uint32_t to_rank = 0;
  uint32_t world = 0;
  uint32_t sock_index = 0;
  uint32_t socks_per_peer = 0;
  Terms terms{};               // the layer above's: every rank must agree on them
  uint32_t wire_security = 0;  // core/options.h WireSecurity: both sides must agree
};

// The verdict of an acceptor that dials this link itself (links on demand, linker.h: when
// both ranks dial at once the lower rank's dial wins). Proved like any verdict.
constexpr uint32_t kDeclinedStatus = 0xDEC1;

// Dialer side. On success fills *keys (left as is under kOff). Throws AuthError when the
// acceptor drops the link after our proof or answers without proving the key,
// ProtocolError/ConfigError on a refusal (with the acceptor's reason), PeerLost when
// there is no answer at all. Returns false (nothing thrown) if `cancel` became true, or
// if the acceptor declined (it dials us itself) and `declined` is given: then *declined.
// With `closed_early` given, an acceptor that closed or reset the connection before its
// challenge (a listener full of strangers' connections drops its oldest, linker.h) also
// returns false, with *closed_early set: the caller dials again.
bool handshake_dial(int fd, const Hello& hello, const LinkSecret& secret,
                    const std::string& peer_addr, Deadline deadline,
                    const std::atomic<bool>* cancel, FrameKeys* keys,
                    bool* declined = nullptr, bool* closed_early = nullptr);

// What handshake_accept reports for a connection whose proof did not check out.
constexpr char kFailedProofWhy[] = "failed the proof of the job key";
// ... and for one it declined (slot() said kSlotDecline).
constexpr char kDeclinedWhy[] = "declined: this rank dials that link itself";

// What `slot(from_rank, sock_index)` answers: take the socket, refuse it as a duplicate
// (a second process claiming that rank), or decline it because this rank is dialing the
// same link (the dialer then waits for our connection).
constexpr int kSlotTake = 0;
constexpr int kSlotDuplicate = 1;
constexpr int kSlotDecline = 2;

struct Accepted {
  Hello hello;
  FrameKeys keys{};  // zeros under kOff
};

// Acceptor side: `mine` is this rank's view (from_rank = this rank). Returns nullopt for a
// connection it dropped, with *dropped_why saying what it failed ("failed the proof of
// the job key"); the caller logs it and keeps accepting. Once the peer has proved the key,
// a disagreement is answered in words and thrown here too. `seen(from_rank, sock_index)`
// answers kSlotTake/kSlotDuplicate/kSlotDecline (a bool: true = already held); it is asked
// only after the proof, so only a peer that holds the key can take or be declined a link.
// `cancel` becoming true ends it within ~0.2 s (nullopt).
template <typename Seen>
std::optional<Accepted> handshake_accept(int fd, const Hello& mine, const LinkSecret& secret,
                                         const SignatureRules& rules, Deadline deadline,
                                         Seen seen, std::string* dropped_why,
                                         const std::atomic<bool>* cancel = nullptr);

// The acceptor's side in steps, for a caller that drives many connections from one
// thread with nonblocking reads (the Linker's acceptor): feed it the dialer's hello, send
// what it returns, then feed it the proof. handshake_accept below is the same steps with
// blocking reads.
class AcceptSteps {
 public:
  static constexpr size_t kHelloBytes = 88;
  static constexpr size_t kProofBytes = 36;

  AcceptSteps(const Hello& mine, const LinkSecret& secret, const SignatureRules& rules)
      : mine_(mine), secret_(secret), rules_(rules) {}
  ~AcceptSteps();
  AcceptSteps(const AcceptSteps&) = delete;
  AcceptSteps& operator=(const AcceptSteps&) = delete;

  // `hello` holds kHelloBytes. Returns the bytes to send: the challenge, or a refusal in
  // words (another build, an off/on mode) after which the connection is dropped with
  // *dropped_why set; empty with *dropped_why set: drop without a word.
  std::string on_hello(const uint8_t* hello, std::string* dropped_why);
  // `proof` holds kProofBytes. A failed proof returns nullopt with *dropped_why; a proved
  // peer is judged, its slot claimed, and the verdict written to `fd` before `deadline`
  // (a proved disagreement is thrown after the verdict went out), as handshake_accept.
  std::optional<Accepted> on_proof(int fd, const uint8_t* proof, Deadline deadline,
                                   int (*slot)(void*, uint32_t, uint32_t), void* ctx,
                                   std::string* dropped_why, const std::atomic<bool>* cancel);

 private:
  const Hello mine_;
  const LinkSecret& secret_;
  const SignatureRules& rules_;
  uint8_t hello_[kHelloBytes] = {};
  uint8_t na_[kLinkNonceBytes] = {};
  Hello theirs_{};
};

std::optional<Accepted> handshake_accept_impl(int fd, const Hello& mine, const LinkSecret& secret,
                                              const SignatureRules& rules, Deadline deadline,
                                              int (*slot)(void*, uint32_t, uint32_t),
                                              void* ctx, std::string* dropped_why,
                                              const std::atomic<bool>* cancel);

template <typename Seen>
std::optional<Accepted> handshake_accept(int fd, const Hello& mine, const LinkSecret& secret,
                                         const SignatureRules& rules, Deadline deadline,
                                         Seen seen, std::string* dropped_why,
                                         const std::atomic<bool>* cancel) {
  return handshake_accept_impl(
      fd, mine, secret, rules, deadline,
      [](void* c, uint32_t r, uint32_t s) {
        return static_cast<int>((*static_cast<Seen*>(c))(r, s));
      },
      &seen,
      dropped_why, cancel);
}

}  // namespace mccl
