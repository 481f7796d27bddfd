// The first bytes on every new link socket. The dialer introduces itself; the acceptor
// checks that both sides belong to the same job (protocol version, communicator id,
// world size, ranks, sockets per peer, frame MACs, and the layer above's terms: opaque
// bytes such as the options that cut messages, explained by its rules) and answers ok or
// the reason it refuses. Either side turns a refusal into a typed error that says what
// differs and what to do.
#pragma once
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

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
  Terms terms{};                       // the layer above's: every rank must agree on them
  uint32_t frame_mac = 0;              // 1: frames carry MACs (both sides must agree)
};

// Dialer side: send `hello`, wait for the verdict. Throws ProtocolError/ConfigError
// (refused, with the acceptor's reason) or PeerLost/Timeout (no answer).
// Returns false (nothing thrown) if `cancel` became true while waiting.
bool handshake_dial(int fd, const Hello& hello, const std::string& peer_addr, Deadline deadline,
                    const std::atomic<bool>* cancel = nullptr);

// Acceptor side: read a hello and check it against this rank's view. On a mismatch it
// answers the reason and throws the same error here. Returns nullopt for a connection
// that is not an MCCL peer at all (bad magic, closed or silent): the caller drops it.
// `seen(from_rank, sock_index)` tells whether that socket was already accepted; `rules`
// explain differing terms.
template <typename Seen>
std::optional<Hello> handshake_accept(int fd, const Hello& mine, const SignatureRules& rules,
                                      Deadline deadline, Seen seen);

// Non-template core of handshake_accept; `duplicate` is evaluated after the basic checks.
std::optional<Hello> handshake_accept_impl(int fd, const Hello& mine, const SignatureRules& rules,
                                           Deadline deadline,
                                           bool (*is_dup)(void*, uint32_t, uint32_t),
                                           void* ctx);

template <typename Seen>
std::optional<Hello> handshake_accept(int fd, const Hello& mine, const SignatureRules& rules,
                                      Deadline deadline, Seen seen) {
  return handshake_accept_impl(
      fd, mine, rules, deadline,
      [](void* c, uint32_t r, uint32_t s) { return (*static_cast<Seen*>(c))(r, s); }, &seen);
}

}  // namespace mccl
