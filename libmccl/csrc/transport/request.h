// One posted send or receive and the key that matches a receive with its frames.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "core/errors.h"
#include "transport/frame.h"
#include "transport/sink.h"

namespace mccl {

// Collectives and point-to-point traffic live in separate sequence spaces.
enum class Channel : uint8_t { kCollective = 0, kP2P = 1 };

struct MsgKey {
  Channel chan = Channel::kCollective;
  uint64_t seq = 0;
  uint32_t tag = 0;
  bool operator==(const MsgKey& o) const {
    return chan == o.chan && seq == o.seq && tag == o.tag;
  }
};

struct MsgKeyHash {
  size_t operator()(const MsgKey& k) const {
    uint64_t h = k.seq * 0x9E3779B97F4A7C15ULL ^ (uint64_t(k.tag) << 1) ^ uint64_t(k.chan);
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

struct Request {
  enum class State : uint8_t { kPending, kDone, kFailed };
  State state = State::kPending;
  bool is_send = false;
  int peer = -1;             // -1: an any-source receive not matched yet
  uint8_t* buf = nullptr;    // receive destination / send source (read only)
  size_t size = 0;
  size_t done = 0;           // bytes moved so far (over all stripes)
  int parts_left = 0;        // send: stripes not yet fully written
  MsgKey key;
  Signature sig{};           // collective: the op's signature (signature.h)
  // Receive: the payload goes to this sink (with its place in buf) instead of into buf.
  std::shared_ptr<const Sink> sink;
  uint64_t cookie = 0;       // the algorithm's own label for this request
  uint64_t post_order = 0;   // for "which request is oldest" in timeout messages
  std::shared_ptr<const Error> error;
  // Set for point-to-point ops (completion goes to the communicator); otherwise the
  // request is queued on the transport's completion queue for the running algorithm.
  std::function<void(Request&)> on_done;

  bool pending() const { return state == State::kPending; }
};
using RequestPtr = std::shared_ptr<Request>;

}  // namespace mccl
