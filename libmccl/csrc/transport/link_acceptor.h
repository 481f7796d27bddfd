// The accepting half of build_mesh: takes the K links each lower rank dials to this rank.
// Every connection's handshake runs on its own short-lived thread (at most
// kMaxPendingHandshakes at once), so a stranger that connects and stays silent holds one
// slot for its 10 s, not the whole set-up, and the real ranks are proved meanwhile.
#pragma once
#include <atomic>

#include "transport/handshake.h"
#include "transport/mesh.h"

namespace mccl {

constexpr int kMaxPendingHandshakes = 32;

// Fills out->links[r][s] (and out->keys) for every r < spec.rank. Returns early, leaving
// gaps, once `stop` is set. Throws the error of a proved peer that was refused, or a
// Timeout at `deadline` that names the missing rank and, when connections were dropped
// for failing the proof, who failed it how often.
void accept_lower_ranks(const MeshSpec& spec, const Hello& mine, const SignatureRules& rules,
                        int listen_fd, Deadline deadline, const std::atomic<bool>& stop,
                        MeshLinks* out);

}  // namespace mccl
