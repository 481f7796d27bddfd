// The keys of one socket of a link: what this side's frames are protected with, and what
// the peer's are checked with. Derived per socket by the link handshake from the job
// secret and both sides' fresh nonces (transport/handshake.h), so no two sockets, jobs or
// directions share one.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mccl {

constexpr size_t kMacKeyBytes = 32;

struct FrameKeys {
  uint8_t send[kMacKeyBytes];
  uint8_t recv[kMacKeyBytes];
};

}  // namespace mccl
