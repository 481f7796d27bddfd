// The receive half of a link: parsing frames off each socket and matching them with
// posted receives (or buffering them as unexpected).
#include <errno.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>

#include "transport/pair.h"

namespace mccl {

namespace {

// Payload remainders at least this large are read straight into the destination;
// smaller ones go through the staging buffer so one recv() also picks up the next headers.
constexpr size_t kDirectReadBytes = 16 << 10;
// One readable socket may not starve the others for longer than this many bytes.
constexpr size_t kReadBudget = 32 << 20;

Channel channel_of(FrameKind k) { return k == FrameKind::kP2P ? Channel::kP2P : Channel::kCollective; }

}  // namespace

void Pair::post_recv(const RequestPtr& req) {
  if (unexpected_.count(req->key)) {
    take_unexpected(req->key, req);
  } else if (byes_ == conns_.size()) {
    lost("no more data will come", 0);  // every socket's stream has been read up to BYE
  } else {
    posted_[req->key] = req;
  }
}

Unexpected* Pair::find_unexpected(const MsgKey& key) {
  auto it = unexpected_.find(key);
  return it == unexpected_.end() ? nullptr : &it->second;
}

void Pair::take_unexpected(const MsgKey& key, const RequestPtr& req) {
  Unexpected& u = unexpected_.at(key);
  check_recv_size(req, u.first);
  if (u.received == u.first.total) {
    copy_out(u, req);
  } else {
    u.waiting = req;
  }
}

void Pair::copy_out(Unexpected& u, const RequestPtr& req) {
  size_t n = u.first.total;
  if (n && req->sink) {
    req->sink->consume(u.data.get(), req->buf, n);
  } else if (n) {
    std::memcpy(req->buf, u.data.get(), n);
  }
  req->done = n;
  MsgKey key{channel_of(u.first.kind), u.first.seq, u.first.tag};
  host_.release_unexpected(std::move(u.data), u.capacity, n);
  unexpected_.erase(key);
  finish_recv(req);
}

void Pair::finish_recv(const RequestPtr& req) {
  req->state = Request::State::kDone;
  host_.request_done(req);
}

void Pair::check_recv_size(const RequestPtr& req, const FrameHeader& h) {
  if (h.total == req->size) return;
  const bool p2p = h.kind == FrameKind::kP2P;
  std::string op = p2p ? "send/recv" : host_.op_name(req->sig);
  std::string what = p2p ? "tag " + std::to_string(h.tag) : "op #" + std::to_string(h.seq);
  throw_error(ErrorKind::kMismatch,
              "[" + op + "] size mismatch with " + who() + ": it sent " +
                  std::to_string(h.total) + " bytes for " + what + ", this rank expects " +
                  std::to_string(req->size) +
                  (p2p ? "; a recv must be posted with the size of the matching send"
                       : "; every rank must pass tensors of the same size"),
              peer_rank_, peer_addr_);
}

void Pair::on_readable(size_t conn) {
  Conn& c = conns_[conn];
  // A receive thread reads it (poll may still report POLLHUP/POLLERR for it, polled for
  // POLLOUT alone when there is no send thread).
  if (c.lent) return;
  size_t budget = kReadBudget;
  while (c.fd.valid() && budget > 0) {
    if (c.rb_begin == c.rb_end) {
      if (c.in_payload && c.land.left() >= RecvThread::kLendBytes && !readers_.empty()) {
        c.lent = true;
        readers_[conn % readers_.size()]->lend(this, conn, c.fd.get(), &c.land);
        return;
      }
      ssize_t r;
      bool direct = c.in_payload && c.land.left() >= kDirectReadBytes;
      if (direct) {
        // Nothing is staged, so a sink's payload may use the staging buffer as its stage.
        r = c.land.recv_from(c.fd.get(), 0, c.rbuf.data(), c.rbuf.size());
      } else {
        r = ::recv(c.fd.get(), c.rbuf.data(), c.rbuf.size(), 0);
      }
      if (r == 0) {
        on_eof(conn);
        return;
      }
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (direct && errno == EBADMSG) auth_failed();
        lost("receive failed", errno);
      }
      budget -= std::min(budget, static_cast<size_t>(r));
      touch_read();
      if (direct) {
        // Bulk data keeps arriving while we copy: read on until EAGAIN.
        if (c.land.left() == 0) on_payload_done(c);
        continue;
      }
      c.rb_begin = 0;
      c.rb_end = static_cast<size_t>(r);
      // A short staging read means the socket is drained (small messages): parse it and
      // return rather than pay a recv() for EAGAIN; poll is level-triggered.
      if (static_cast<size_t>(r) < c.rbuf.size()) budget = 0;
    }
    while (c.rb_begin < c.rb_end) {
      size_t avail = c.rb_end - c.rb_begin;
      const uint8_t* src = c.rbuf.data() + c.rb_begin;
      if (!c.in_payload) {
        const size_t need = header_bytes();
        size_t take = std::min(need - c.header_have, avail);
        std::memcpy(c.header_buf + c.header_have, src, take);
        c.header_have += take;
        c.rb_begin += take;
        if (c.header_have == need) {
          c.header_have = 0;
          on_header(c);
        }
      } else {
        size_t take = std::min(c.land.left(), avail);
        if (!c.land.put(src, take)) auth_failed();
        c.rb_begin += take;
        if (c.land.left() == 0) on_payload_done(c);
      }
    }
  }
}

void Pair::on_returned(const RecvDone& d) {
  Conn& c = conns_[d.conn];
  c.lent = false;
  if (d.err == RecvDone::kEof) lost("connection closed by the peer", 0);
  if (d.err == EBADMSG) auth_failed();
  if (d.err) lost("receive failed", d.err);
  on_payload_done(c);
  on_readable(d.conn);  // the next header is likely there already
}

void Pair::land_in(Conn& c, const RequestPtr& req, const FrameHeader& h) {
  const size_t unit = req->sink ? req->sink->unit() : 1;
  if (h.offset % unit || h.length % unit) {
    throw_error(ErrorKind::kProtocol,
                "[transport] " + who() + " sent a frame at byte " + std::to_string(h.offset) +
                    " (+" + std::to_string(h.length) + ") of a receive taken in " +
                    std::to_string(unit) +
                    "-byte units, splitting a unit; likely cause: ranks run different "
                    "MCCL versions; run the same one everywhere",
                peer_rank_, peer_addr_);
  }
  c.land.start(req->buf + h.offset, h.length, req->sink.get());
}

void Pair::open_header(Conn& c) {
  // The stream follows from the kind, itself covered by the tag: a kind altered on the way
  // picks the wrong stream's record number and fails like any other alteration.
  const uint16_t kind = static_cast<uint16_t>(c.header_buf[6] | c.header_buf[7] << 8);
  const bool control = kind == static_cast<uint16_t>(FrameKind::kAbort) || kind == static_cast<uint16_t>(FrameKind::kBye);
  if (!c.opener->open(control ? RecordStream::kControl : RecordStream::kData, c.header_buf, kFrameHeaderBytes,
                      nullptr, 0, c.header_buf + kFrameHeaderBytes)) {
    auth_failed();
  }
}

void Pair::auth_failed() {
  throw_error(ErrorKind::kAuth,
              "[engine] frame from " + who() +
                  " failed authentication (altered or injected on the way, or a different job "
                  "key); no byte that failed its tag was written to the destination buffer (it "
                  "holds what it held before wherever no authentic record landed), but the op's "
                  "output is incomplete; the communicator is failed; check the network path "
                  "between the hosts and that every rank uses the same job key (MCCL_JOB_KEY_FILE)",
              peer_rank_, peer_addr_);
}

void Pair::on_header(Conn& c) {
  if (sealed_) open_header(c);  // before any field is believed
  FrameHeader h = decode_header(c.header_buf);
  validate_header(h, comm_id_, peer_rank_, peer_addr_);
  c.cur = h;
  c.target.reset();
  c.unexpected = nullptr;
  const bool control = h.kind == FrameKind::kAbort || h.kind == FrameKind::kBye;
  if (h.kind == FrameKind::kBye) {
    c.land.start(nullptr, 0);  // no payload; acted on once whole (on_payload_done)
  } else if (h.kind == FrameKind::kAbort) {
    if (h.offset != 0 || h.length != h.total) {
      throw_error(ErrorKind::kProtocol, "[transport] split abort frame from " + who(), peer_rank_,
                  peer_addr_);
    }
    c.control.assign(h.length, '\0');
    c.land.start(reinterpret_cast<uint8_t*>(&c.control[0]), h.length);
  } else {
    MsgKey key{channel_of(h.kind), h.seq, h.tag};
    if (key.chan == Channel::kCollective) host_.check_collective_frame(*this, h);
    RequestPtr req;
    auto it = posted_.find(key);
    if (it != posted_.end()) {
      req = it->second;
    } else if (key.chan == Channel::kP2P && !unexpected_.count(key)) {
      req = host_.claim_for_any_source(*this, h);
    }
    if (req) {
      check_recv_size(req, h);
      c.target = req;
      land_in(c, req, h);
    } else {
      auto ins = unexpected_.try_emplace(key);
      Unexpected& u = ins.first->second;
      if (ins.second) {
        try {
          u.data = host_.reserve_unexpected(*this, h, &u.capacity);
        } catch (...) {
          unexpected_.erase(ins.first);
          throw;
        }
        u.first = h;
        u.arrival = host_.next_arrival();
      } else if (u.first.total != h.total) {
        throw_error(ErrorKind::kProtocol,
                    "[transport] inconsistent stripes from " + who() + " for one message",
                    peer_rank_, peer_addr_);
      }
      c.unexpected = &u;
      c.land.start(u.data.get() + h.offset, h.length);
    }
  }
  if (sealed_) {
    c.land.unseal(c.opener.get(), control ? RecordStream::kControl : RecordStream::kData, c.header_buf,
                  kFrameHeaderBytes);
  }
  c.in_payload = true;
  if (c.land.left() == 0) on_payload_done(c);
}

void Pair::on_payload_done(Conn& c) {
  c.in_payload = false;
  const FrameHeader& h = c.cur;
  if (h.kind == FrameKind::kBye) {
    if (!c.bye) {
      c.bye = true;
      ++byes_;
    }
    return;
  }
  if (h.kind == FrameKind::kAbort) {
    AbortInfo info;
    if (!decode_abort(reinterpret_cast<const uint8_t*>(c.control.data()), c.control.size(),
                      &info)) {
      throw_error(ErrorKind::kProtocol, "[transport] malformed abort frame from " + who(),
                  peer_rank_, peer_addr_);
    }
    std::string msg = info.message;
    if (info.origin_rank != peer_rank_ || info.lost_rank != peer_rank_) {
      msg += " (reported by rank " + std::to_string(info.origin_rank) + ")";
    }
    throw RemoteAbort(static_cast<ErrorKind>(info.kind), msg, info.lost_rank, info.lost_addr,
                      info.origin_rank, info.message);
  }
  bytes_received_.fetch_add(h.length, std::memory_order_relaxed);
  if (c.target) {
    RequestPtr req = std::move(c.target);
    req->done += h.length;
    if (req->done == req->size && req->pending()) {
      posted_.erase(req->key);
      finish_recv(req);
    }
  } else if (c.unexpected) {
    Unexpected* u = c.unexpected;
    c.unexpected = nullptr;
    u->received += h.length;
    if (u->received == u->first.total && u->waiting) {
      RequestPtr req = std::move(u->waiting);
      copy_out(*u, req);
    }
  }
}

void Pair::on_eof(size_t conn) {
  if (writer_running()) {
    writer_->pause();  // it may be about to write to this descriptor
    conns_[conn].fd.reset();
    writer_->resume();
  } else {
    conns_[conn].fd.reset();
  }
  if (conns_[conn].bye) {
    // An orderly close of this socket; the peer's data may still come on the others.
    if (byes_ == conns_.size() && has_pending()) lost("connection closed after shutdown", 0);
    return;
  }
  lost("connection closed by the peer", 0);
}

}  // namespace mccl
