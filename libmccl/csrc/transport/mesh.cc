#include "transport/mesh.h"

#include <fcntl.h>

#include <cerrno>
#include <cstring>

#include "core/errors.h"
#include "transport/handshake.h"

namespace mccl {

namespace {

Hello hello_of(const MeshSpec& spec) {
  Hello h;
  h.comm_id = spec.comm_id;
  h.from_rank = static_cast<uint32_t>(spec.rank);
  h.world = static_cast<uint32_t>(spec.size);
  h.socks_per_peer = static_cast<uint32_t>(spec.sockets_per_peer);
  h.terms = spec.terms;
  h.wire_security = spec.wire_security;
  return h;
}

const SignatureRules& rules_of(const MeshSpec& spec) {
  static const OpaqueSignatureRules opaque;
  return spec.rules ? *spec.rules : opaque;
}

}  // namespace

std::vector<Fd> dup_link(const MeshSpec& spec, int peer, const std::vector<int>& fds) {
  const int k = spec.sockets_per_peer;
  if (peer < 0 || peer >= spec.size || peer == spec.rank) {
    throw_error(ErrorKind::kConfig, "[transport] sockets handed in for rank " +
                                        std::to_string(peer) + ", which is not a peer of rank " +
                                        std::to_string(spec.rank) + " in a world of " +
                                        std::to_string(spec.size));
  }
  if (static_cast<int>(fds.size()) != k) {
    throw_error(ErrorKind::kConfig,
                "[transport] got " + std::to_string(fds.size()) + " socket(s) for rank " +
                    std::to_string(peer) + ", expected " + std::to_string(k) +
                    " (MCCL_SOCKETS_PER_PEER); hand the same number of sockets to every peer");
  }
  std::vector<Fd> out(k);
  for (int s = 0; s < k; ++s) {
    int dup = ::fcntl(fds[s], F_DUPFD_CLOEXEC, 0);
    if (dup < 0) {
      throw_error(ErrorKind::kConfig, "[transport] socket " + std::to_string(s) + " for rank " +
                                          std::to_string(peer) + " is not an open fd (" +
                                          std::strerror(errno) + "); pass connected sockets");
    }
    out[s] = Fd(dup);
  }
  return out;
}

NewLink prove_link(const MeshSpec& spec, int peer, std::vector<Fd> fds, Deadline deadline,
                   const std::atomic<bool>* cancel) {
  const int k = static_cast<int>(fds.size());
  const std::string& addr = spec.peer_addrs[peer];
  const auto cancelled = [&] {
    throw_error(ErrorKind::kAborted, "[transport] the handshake on the sockets handed in for " +
                                         std::string("peer=") + addr + " (rank " +
                                         std::to_string(peer) + ") was interrupted",
                peer, addr);
  };
  Hello mine = hello_of(spec);
  NewLink link;
  link.peer = peer;
  link.fds.resize(k);
  std::vector<FrameKeys> got_keys(k);
  for (int s = 0; s < k; ++s) {
    Fd& fd = fds[s];
    if (spec.rank < peer) {
      Hello h = mine;
      h.to_rank = static_cast<uint32_t>(peer);
      h.sock_index = static_cast<uint32_t>(s);
      if (!handshake_dial(fd.get(), h, spec.secret, addr, deadline, cancel, &got_keys[s])) {
        cancelled();
      }
      link.fds[s] = std::move(fd);
      continue;
    }
    auto seen = [&](uint32_t r, uint32_t i) {
      return r == static_cast<uint32_t>(peer) && i < link.fds.size() && link.fds[i].valid();
    };
    std::string why;
    auto hello = handshake_accept(fd.get(), mine, spec.secret, rules_of(spec), deadline, seen,
                                  &why, cancel);
    if (!hello && cancel && cancel->load()) cancelled();
    if (!hello && why == kFailedProofWhy) {
      // The caller authenticated this socket's peer already: a failed proof here is a
      // different engine secret (another fleet key or job), not a stranger.
      throw_error(ErrorKind::kAuth,
                  "[transport] handed-in socket " + std::to_string(s) + " to peer=" + addr +
                      " (rank " + std::to_string(peer) +
                      ") failed the proof of the job key; likely cause: the two sides hold "
                      "different job keys (fleet key / MCCL_JOB_KEY_FILE); give them the same",
                  peer, addr);
    }
    if (!hello) {
      throw_error(ErrorKind::kPeerLost,
                  "[transport] handed-in socket " + std::to_string(s) + " to peer=" + addr +
                      " (rank " + std::to_string(peer) + ") " + why +
                      "; likely cause: the peer did not build its communicator on the same "
                      "sockets; check both sides agreed on the socket list",
                  peer, addr);
    }
    if (hello->hello.from_rank != static_cast<uint32_t>(peer)) {
      throw_error(ErrorKind::kConfig,
                  "[transport] the socket handed in for rank " + std::to_string(peer) +
                      " reaches rank " + std::to_string(hello->hello.from_rank) +
                      "; the two sides disagree on which socket serves which peer",
                  peer, addr);
    }
    link.fds[hello->hello.sock_index] = std::move(fd);
    got_keys[hello->hello.sock_index] = hello->keys;
    wipe(&hello->keys, sizeof(hello->keys));
  }
  for (auto& fd : link.fds) {
    configure_link_socket(fd.get(), spec.socket_buffer_bytes);
    set_nonblocking(fd.get(), true);
  }
  if (spec.wire_security != 0) link.keys = got_keys;
  wipe(got_keys.data(), got_keys.size() * sizeof(FrameKeys));
  return link;
}

MeshLinks adopt_mesh(const MeshSpec& spec, const std::vector<std::vector<int>>& fds,
                     Deadline deadline) {
  if (static_cast<int>(fds.size()) != spec.size) {
    throw_error(ErrorKind::kConfig, "[transport] got sockets for " + std::to_string(fds.size()) +
                                        " ranks in a world of " + std::to_string(spec.size) +
                                        "; pass one list per rank (empty for this rank)");
  }
  // Every fd is checked (and dup()ed) before any handshake, so a bad list fails at once.
  std::vector<std::vector<Fd>> dups(spec.size);
  for (int peer = 0; peer < spec.size; ++peer) {
    if (!fds[peer].empty()) dups[peer] = dup_link(spec, peer, fds[peer]);
  }
  MeshLinks mesh;
  mesh.links.resize(spec.size);
  if (spec.wire_security != 0) mesh.keys.resize(spec.size);
  for (int peer = 0; peer < spec.size; ++peer) {
    if (dups[peer].empty()) continue;
    NewLink link = prove_link(spec, peer, std::move(dups[peer]), deadline, nullptr);
    mesh.links[peer] = std::move(link.fds);
    if (!mesh.keys.empty()) mesh.keys[peer] = link.keys;
    wipe(link.keys.data(), link.keys.size() * sizeof(FrameKeys));
  }
  return mesh;
}

}  // namespace mccl
