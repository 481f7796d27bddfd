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

MeshLinks empty_mesh(const MeshSpec& spec, const std::vector<std::vector<int>>& fds) {
  MeshLinks m;
  m.links.resize(spec.size);
  if (spec.wire_security != 0) m.keys.resize(spec.size);
  for (int r = 0; r < spec.size; ++r) {
    if (r == spec.rank || fds[r].empty()) continue;
    m.links[r].resize(spec.sockets_per_peer);
    if (!m.keys.empty()) m.keys[r].resize(spec.sockets_per_peer);
  }
  return m;
}

}  // namespace

MeshLinks adopt_mesh(const MeshSpec& spec, const std::vector<std::vector<int>>& fds,
                     Deadline deadline) {
  const int k = spec.sockets_per_peer;
  if (static_cast<int>(fds.size()) != spec.size) {
    throw_error(ErrorKind::kConfig, "[transport] got sockets for " + std::to_string(fds.size()) +
                                        " ranks in a world of " + std::to_string(spec.size) +
                                        "; pass one list per rank (empty for this rank)");
  }
  MeshLinks mesh = empty_mesh(spec, fds);
  auto& links = mesh.links;
  for (int peer = 0; peer < spec.size; ++peer) {
    const size_t want = peer == spec.rank ? 0 : static_cast<size_t>(k);
    if (fds[peer].size() != want && !fds[peer].empty()) {
      throw_error(ErrorKind::kConfig,
                  "[transport] got " + std::to_string(fds[peer].size()) + " socket(s) for rank " +
                      std::to_string(peer) + ", expected " + std::to_string(want) +
                      " (MCCL_SOCKETS_PER_PEER) or none; hand the same number of sockets to "
                      "every leased peer");
    }
    if (fds[peer].empty()) continue;
    for (int s = 0; s < k; ++s) {
      int dup = ::fcntl(fds[peer][s], F_DUPFD_CLOEXEC, 0);
      if (dup < 0) {
        throw_error(ErrorKind::kConfig, "[transport] socket " + std::to_string(s) + " for rank " +
                                            std::to_string(peer) + " is not an open fd (" +
                                            std::strerror(errno) + "); pass connected sockets");
      }
      links[peer][s] = Fd(dup);
    }
  }
  Hello mine = hello_of(spec);
  for (int peer = 0; peer < spec.size; ++peer) {
    if (fds[peer].empty()) continue;
    const std::string& addr = spec.peer_addrs[peer];
    std::vector<Fd> got(k);
    std::vector<FrameKeys> got_keys(k);
    for (int s = 0; s < k; ++s) {
      Fd& fd = links[peer][s];
      if (spec.rank < peer) {
        Hello h = mine;
        h.to_rank = static_cast<uint32_t>(peer);
        h.sock_index = static_cast<uint32_t>(s);
        handshake_dial(fd.get(), h, spec.secret, addr, deadline, nullptr, &got_keys[s]);
        got[s] = std::move(fd);
        continue;
      }
      auto seen = [&](uint32_t r, uint32_t i) {
        return r == static_cast<uint32_t>(peer) && i < got.size() && got[i].valid();
      };
      std::string why;
      auto hello = handshake_accept(fd.get(), mine, spec.secret, rules_of(spec), deadline, seen,
                                    &why);
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
      got[hello->hello.sock_index] = std::move(fd);
      got_keys[hello->hello.sock_index] = hello->keys;
      wipe(&hello->keys, sizeof(hello->keys));
    }
    for (auto& fd : got) {
      configure_link_socket(fd.get(), spec.socket_buffer_bytes);
      set_nonblocking(fd.get(), true);
    }
    links[peer] = std::move(got);
    if (!mesh.keys.empty()) mesh.keys[peer] = got_keys;
    wipe(got_keys.data(), got_keys.size() * sizeof(FrameKeys));
  }
  return mesh;
}

}  // namespace mccl
