// What every link of a communicator is built from (MeshSpec) and a set of built links
// (MeshLinks). Links on demand over the engine's own listener are the Linker's
// (transport/linker.h).
//
// adopt_mesh builds links on sockets the caller already connected (the daemon's
// authenticated, pooled data sockets, to the peers it leased): no listening or dialing,
// but the same keyed handshake per socket (transport/handshake.h), so the job secret is
// proved, comm id, ranks and options are checked, and fresh frame keys are derived for
// every job.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "integrity/keys.h"
#include "integrity/link_crypto.h"
#include "transport/link_source.h"
#include "transport/signature.h"
#include "transport/socket.h"

namespace mccl {

struct MeshSpec {
  int rank = 0;
  int size = 1;
  uint64_t comm_id = 0;
  int sockets_per_peer = 2;
  int socket_buffer_bytes = 4 << 20;
  Terms terms{};                        // checked equal on every link (handshake) ...
  std::shared_ptr<const SignatureRules> rules;  // ... and explained by these (null: bytes)
  uint32_t wire_security = 0;           // core/options.h WireSecurity; checked equal on every link
  LinkSecret secret;                    // the job secret every link proves (empty: kOff)
  std::vector<std::string> peer_addrs;  // one per rank, "host:port"
};

// links[peer][k] (empty for peer == rank and peers without a link), configured and nonblocking; keys[peer][k] the
// frame keys the handshake derived for that socket (keys is empty under kOff).
struct MeshLinks {
  std::vector<std::vector<Fd>> links;
  std::vector<std::vector<FrameKeys>> keys;
};

// `fds[peer]` holds K connected sockets to `peer`, in the order both sides agreed on, or
// none: no link to that peer (this rank, or a peer the caller did not lease; an op that
// needs it fails with a ConfigError naming it, transport.h). Each is dup()ed: the links own only the dups, the caller keeps its fds.
// The lower rank speaks first on each socket, as the lower rank's dial would. Peers are
// handled in rank order on every rank, which is one global order of the pairs, so the
// blocking handshakes cannot wait on each other in a cycle.
MeshLinks adopt_mesh(const MeshSpec& spec,
                                        const std::vector<std::vector<int>>& fds,
                                        Deadline deadline);

// One peer's part of adopt_mesh, for a link handed in later (handed_links.h): dups the
// caller's K sockets to `peer` (throws a ConfigError for a wrong count or a closed fd) ...
std::vector<Fd> dup_link(const MeshSpec& spec, int peer, const std::vector<int>& fds);
// ... then runs the keyed handshake on the dups (the lower rank speaks first) and returns
// the proved link. `cancel` (may be null) becoming true ends it early with kAborted.
NewLink prove_link(const MeshSpec& spec, int peer, std::vector<Fd> fds, Deadline deadline,
                   const std::atomic<bool>* cancel);

}  // namespace mccl
