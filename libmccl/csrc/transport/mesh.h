// Builds the full mesh of links of a communicator: rank i dials every j > i
// (K sockets each) and accepts K sockets from every j < i, all under one deadline.
// Dialing and accepting run concurrently so set-up time does not grow with the
// chain of ranks waiting for each other.
//
// adopt_mesh builds the same links on sockets the caller already connected (the daemon's
// authenticated, pooled data sockets): no listening or dialing, but the same keyed
// handshake per socket (transport/handshake.h), so the job secret is proved, comm id,
// ranks and options are checked, and fresh frame keys are derived for every job.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "integrity/keys.h"
#include "integrity/link_crypto.h"
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

// links[peer][k] (empty for peer == rank), configured and nonblocking; keys[peer][k] the
// frame keys the handshake derived for that socket (keys is empty under kOff).
struct MeshLinks {
  std::vector<std::vector<Fd>> links;
  std::vector<std::vector<FrameKeys>> keys;
};

// Setting `*cancel` from another thread stops it within ~0.2 s with AbortedError. A
// connection that does not prove the job key is dropped and logged (transport/rejects.h);
// the acceptor keeps accepting until the deadline.
MeshLinks build_mesh(const MeshSpec& spec, int listen_fd, Deadline deadline,
                                        std::atomic<bool>* cancel = nullptr);

// `fds[peer]` holds K connected sockets to `peer` (empty for this rank), in the order both
// sides agreed on. Each is dup()ed: the links own only the dups, the caller keeps its fds.
// The lower rank speaks first on each socket, as the dialer does in build_mesh. Peers are
// handled in rank order on every rank, which is one global order of the pairs, so the
// blocking handshakes cannot wait on each other in a cycle.
MeshLinks adopt_mesh(const MeshSpec& spec,
                                        const std::vector<std::vector<int>>& fds,
                                        Deadline deadline);

}  // namespace mccl
