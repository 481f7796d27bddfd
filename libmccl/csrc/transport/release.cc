// Handing borrowed sockets back at a clean stream boundary, so that the daemon can run
// its next job's communicator on the same authenticated sockets.
//
// Both sides send BYE on every socket and then read exactly up to the peer's BYE. Nothing
// is read past it: the peer sends its next job's bytes only after it has read our BYE,
// and those bytes belong to the next communicator's handshake. No shutdown(2) on a
// clean end, since the socket is shared with its owner; an unclean one is shut down so
// that the peer, which may be waiting for our BYE, learns at once that it is gone.
#include <sys/socket.h>

#include <cstring>

#include "transport/frame.h"
#include "transport/pair.h"
#include "transport/transport.h"

namespace mccl {

bool Transport::release(Deadline deadline) {
  // The sockets go back to their owner: the send thread must be off them for good, and
  // the send queues (checked below) are this thread's alone from here.
  halt_writer();
  halt_readers();  // a socket still lent is mid-payload: Pair::release refuses it
  // A link still being handed in has handshake bytes in flight on its sockets.
  bool clean = !failed_ && (!linker_ || linker_->settled());
  for (auto& p : pairs_) {
    if (!p) continue;
    if (clean) {
      clean = p->release(deadline);
    } else {
      p->close();
    }
  }
  return clean;
}

bool Pair::release(Deadline deadline) {
  FrameHeader h;
  h.kind = FrameKind::kBye;
  h.comm_id = comm_id_;
  // Messages that arrived whole but were never received (an eager p2p send nobody took)
  // die with this communicator; they do not matter to the streams. What would: a frame
  // half-written or half-read, which the checks below refuse.
  bool clean = true;
  for (auto& c : conns_) {
    if (!clean) break;
    clean = c.fd.valid() && c.sendq.empty() && !c.in_payload;
    if (!clean) break;
    const std::string bye = control_frame(c, h, std::string());
    clean = write_all(c.fd.get(), bye.data(), bye.size(), deadline);
  }
  for (auto& c : conns_) {
    if (!clean) break;
    clean = read_to_bye(c, deadline);
  }
  if (!clean) {
    close();
    return false;
  }
  for (auto& c : conns_) c.fd.reset();
  return true;
}

bool Pair::read_to_bye(Conn& c, Deadline deadline) {
  size_t leftover = c.rb_end - c.rb_begin;
  if (c.bye) {
    // The BYE was parsed while idle: it must have been the last byte read.
    return leftover == 0 && c.header_have == 0;
  }
  // Exactly the BYE (its header, and its tag when sealed) is left to read.
  const size_t need = header_bytes();
  if (c.in_payload || c.header_have + leftover > need) return false;  // a frame after all ops
  std::memcpy(c.header_buf + c.header_have, c.rbuf.data() + c.rb_begin, leftover);
  c.header_have += leftover;
  c.rb_begin = c.rb_end;
  if (!read_all(c.fd.get(), c.header_buf + c.header_have, need - c.header_have, deadline)) {
    return false;  // the peer is late, gone, or closed the socket
  }
  c.header_have = 0;
  if (sealed_) {
    try {
      open_header(c);
    } catch (const Error&) {
      return false;  // not the peer's BYE: the socket is not reused
    }
  }
  FrameHeader h = decode_header(c.header_buf);
  if (h.magic != kFrameMagic || h.version != kProtocolVersion || h.comm_id != comm_id_ ||
      h.kind != FrameKind::kBye || h.total != 0) {
    return false;
  }
  c.bye = true;
  ++byes_;
  return true;
}

}  // namespace mccl
