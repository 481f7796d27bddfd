#include "transport/pair.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

namespace mccl {

namespace {

constexpr size_t kStageBytes = 64 << 10;
// Payload remainders at least this large are read straight into the destination;
// smaller ones go through the staging buffer so one recv() also picks up the next headers.
constexpr size_t kDirectReadBytes = 16 << 10;
constexpr int kMaxIov = 64;
// One readable socket may not starve the others for longer than this many bytes.
constexpr size_t kReadBudget = 32 << 20;

Channel channel_of(OpKind k) { return k == OpKind::kP2P ? Channel::kP2P : Channel::kCollective; }

}  // namespace

Pair::Pair(PairHost& host, int peer_rank, std::string peer_addr, uint64_t comm_id,
           std::vector<Fd> fds)
    : host_(host), peer_rank_(peer_rank), peer_addr_(std::move(peer_addr)), comm_id_(comm_id) {
  conns_.resize(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    conns_[i].fd = std::move(fds[i]);
    conns_[i].rbuf.resize(kStageBytes);
  }
}

std::string Pair::who() const {
  return "peer=" + peer_addr_ + " (rank " + std::to_string(peer_rank_) + ")";
}

void Pair::drain_for_abort() {
  // A failing peer sends ABORT on every socket before it closes them; the frame may sit
  // unread behind the error we just hit. Read what is there (briefly) so the caller
  // reports the original failure instead of "connection closed" by a fellow survivor.
  draining_ = true;
  Deadline end = Clock::now() + std::chrono::milliseconds(50);
  for (size_t i = 0; i < conns_.size(); ++i) {
    while (conns_[i].fd.valid()) {
      pollfd p{conns_[i].fd.get(), POLLIN, 0};
      if (::poll(&p, 1, ms_until(end, 50)) <= 0) break;
      try {
        on_readable(i);  // throws RemoteAbort if the ABORT frame is there
      } catch (const RemoteAbort&) {
        throw;
      } catch (const Error&) {
        break;  // EOF or reset on this socket: nothing more to read from it
      }
    }
  }
  draining_ = false;
}

void Pair::lost(const std::string& what, int err) {
  if (!draining_) drain_for_abort();
  if (byes_ > 0) {
    throw_error(ErrorKind::kPeerLost,
                "[transport] " + who() +
                    " has shut down its communicator, but this rank still exchanges data with "
                    "it; likely cause: ranks disagree on the number of collectives or p2p ops; "
                    "make every rank issue the same sequence before shutdown",
                peer_rank_, peer_addr_);
  }
  std::string cause = err ? std::string(": ") + std::strerror(err) : std::string();
  throw_error(ErrorKind::kPeerLost,
              "[transport] lost " + who() + ": " + what + cause +
                  "; likely cause: that process exited or was killed, or the network dropped "
                  "the link; check that rank's log, then restart the job",
              peer_rank_, peer_addr_);
}

// ---------------------------------------------------------------- sending

void Pair::post_send(const RequestPtr& req) {
  const size_t n = req->size;
  const size_t k = conns_.size();
  const size_t stripes = (n >= kStripeBytes && k > 1) ? k : 1;
  req->parts_left = static_cast<int>(stripes);
  size_t first_conn = stripes == 1 ? (next_conn_++ % k) : 0;
  for (size_t s = 0; s < stripes; ++s) {
    size_t off = n * s / stripes;
    size_t len = n * (s + 1) / stripes - off;
    FrameHeader h;
    h.kind = req->sig.kind;
    h.comm_id = comm_id_;
    h.seq = req->key.seq;
    h.tag = req->key.tag;
    h.offset = off;
    h.length = len;
    h.total = n;
    h.op_bytes = req->sig.op_bytes;
    h.dtype = req->sig.dtype;
    h.redop = req->sig.redop;
    h.root = req->sig.root;
    SendItem item;
    item.req = req;
    encode_header(h, item.header);
    item.payload = req->buf + off;
    item.length = len;
    enqueue(first_conn + s, std::move(item));
  }
}

void Pair::enqueue(size_t conn, SendItem&& item) {
  Conn& c = conns_[conn];
  if (!c.fd.valid()) lost("link already closed", 0);
  bool was_idle = c.sendq.empty();
  if (queued_ == 0) last_write_ = Clock::now();  // a stall counts from the first queued send
  ++queued_;
  c.sendq.push_back(std::move(item));
  if (was_idle) flush(conn);  // most sends complete right here, without a poll round
}

void Pair::flush(size_t conn) {
  Conn& c = conns_[conn];
  while (!c.sendq.empty()) {
    iovec iov[kMaxIov];
    int cnt = 0;
    for (auto it = c.sendq.begin(); it != c.sendq.end() && cnt + 2 <= kMaxIov; ++it) {
      if (it->header_sent < kFrameHeaderBytes) {
        iov[cnt++] = {it->header + it->header_sent, kFrameHeaderBytes - it->header_sent};
      }
      if (it->sent < it->length) {
        iov[cnt++] = {const_cast<uint8_t*>(it->payload) + it->sent, it->length - it->sent};
      }
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = cnt;
    ssize_t w = ::sendmsg(c.fd.get(), &msg, nosignal_flag() | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      lost("send failed", errno);
    }
    if (w > 0) last_write_ = Clock::now();
    size_t left = static_cast<size_t>(w);
    while (!c.sendq.empty()) {
      SendItem& it = c.sendq.front();
      size_t h = std::min(left, kFrameHeaderBytes - it.header_sent);
      it.header_sent += h;
      left -= h;
      size_t p = std::min(left, it.length - it.sent);
      it.sent += p;
      left -= p;
      if (it.header_sent < kFrameHeaderBytes || it.sent < it.length) break;
      RequestPtr req = std::move(it.req);
      size_t len = it.length;
      c.sendq.pop_front();
      --queued_;
      if (req) {
        bytes_sent_.fetch_add(len, std::memory_order_relaxed);
        if (req->pending() && --req->parts_left == 0) {
          req->done = req->size;
          req->state = Request::State::kDone;
          host_.request_done(req);
        }
      }
    }
  }
}

void Pair::on_writable(size_t conn) {
  if (conns_[conn].fd.valid()) flush(conn);
}

void Pair::send_control(const FrameHeader& h, const std::string& payload, Deadline deadline) {
  std::string bytes(kFrameHeaderBytes + payload.size(), '\0');
  encode_header(h, reinterpret_cast<uint8_t*>(&bytes[0]));
  std::copy(payload.begin(), payload.end(), bytes.begin() + kFrameHeaderBytes);
  for (size_t i = 0; i < conns_.size(); ++i) {
    Conn& c = conns_[i];
    if (!c.fd.valid()) continue;
    try {
      // A control frame may only start at a frame boundary: finish a half-sent frame.
      while (!c.sendq.empty() && c.sendq.front().started() && Clock::now() < deadline) {
        flush(i);
        if (c.sendq.empty() || !c.sendq.front().started()) break;
        pollfd p{c.fd.get(), POLLOUT, 0};
        ::poll(&p, 1, ms_until(deadline, 100));
      }
      if (!c.sendq.empty() && c.sendq.front().started()) continue;
      write_all(c.fd.get(), bytes.data(), bytes.size(), deadline);
    } catch (const Error&) {
      // best effort: this socket is already broken
    }
  }
}

// ---------------------------------------------------------------- receiving

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
  if (n) std::memcpy(req->buf, u.data.get(), n);
  req->done = n;
  MsgKey key{channel_of(u.first.kind), u.first.seq, u.first.tag};
  unexpected_.erase(key);
  host_.release_unexpected(n);
  finish_recv(req);
}

void Pair::finish_recv(const RequestPtr& req) {
  req->state = Request::State::kDone;
  host_.request_done(req);
}

void Pair::check_recv_size(const RequestPtr& req, const FrameHeader& h) {
  if (h.total == req->size) return;
  const bool p2p = h.kind == OpKind::kP2P;
  std::string op = p2p ? "send/recv" : op_kind_name(req->sig.kind);
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
  size_t budget = kReadBudget;
  while (c.fd.valid() && budget > 0) {
    if (c.rb_begin == c.rb_end) {
      ssize_t r;
      bool direct = c.in_payload && c.left >= kDirectReadBytes;
      if (direct) {
        r = ::recv(c.fd.get(), c.dst, c.left, 0);
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
        lost("receive failed", errno);
      }
      budget -= std::min(budget, static_cast<size_t>(r));
      if (direct) {
        c.dst += r;
        c.left -= static_cast<size_t>(r);
        if (c.left == 0) on_payload_done(c);
        continue;
      }
      c.rb_begin = 0;
      c.rb_end = static_cast<size_t>(r);
    }
    while (c.rb_begin < c.rb_end) {
      size_t avail = c.rb_end - c.rb_begin;
      const uint8_t* src = c.rbuf.data() + c.rb_begin;
      if (!c.in_payload) {
        size_t take = std::min(kFrameHeaderBytes - c.header_have, avail);
        std::memcpy(c.header_buf + c.header_have, src, take);
        c.header_have += take;
        c.rb_begin += take;
        if (c.header_have == kFrameHeaderBytes) {
          c.header_have = 0;
          on_header(c);
        }
      } else {
        size_t take = std::min(c.left, avail);
        std::memcpy(c.dst, src, take);
        c.dst += take;
        c.left -= take;
        c.rb_begin += take;
        if (c.left == 0) on_payload_done(c);
      }
    }
  }
}

void Pair::on_header(Conn& c) {
  FrameHeader h = decode_header(c.header_buf);
  validate_header(h, comm_id_, peer_rank_, peer_addr_);
  c.cur = h;
  c.target.reset();
  c.unexpected = nullptr;
  if (h.kind == OpKind::kBye) {
    if (!c.bye) {
      c.bye = true;
      ++byes_;
    }
    return;
  }
  if (h.kind == OpKind::kAbort) {
    if (h.offset != 0 || h.length != h.total) {
      throw_error(ErrorKind::kProtocol, "[transport] split abort frame from " + who(), peer_rank_,
                  peer_addr_);
    }
    c.control.assign(h.length, '\0');
    c.dst = reinterpret_cast<uint8_t*>(&c.control[0]);
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
      c.dst = req->buf + h.offset;
    } else {
      auto ins = unexpected_.try_emplace(key);
      Unexpected& u = ins.first->second;
      if (ins.second) {
        try {
          host_.reserve_unexpected(*this, h);
        } catch (...) {
          unexpected_.erase(ins.first);
          throw;
        }
        u.first = h;
        u.data.reset(new uint8_t[std::max<uint64_t>(h.total, 1)]);
        u.arrival = host_.next_arrival();
      } else if (u.first.total != h.total) {
        throw_error(ErrorKind::kProtocol,
                    "[transport] inconsistent stripes from " + who() + " for one message",
                    peer_rank_, peer_addr_);
      }
      c.unexpected = &u;
      c.dst = u.data.get() + h.offset;
    }
  }
  c.left = h.length;
  c.in_payload = true;
  if (c.left == 0) on_payload_done(c);
}

void Pair::on_payload_done(Conn& c) {
  c.in_payload = false;
  const FrameHeader& h = c.cur;
  if (h.kind == OpKind::kAbort) {
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
  conns_[conn].fd.reset();
  if (conns_[conn].bye) {
    // An orderly close of this socket; the peer's data may still come on the others.
    if (byes_ == conns_.size() && has_pending()) lost("connection closed after shutdown", 0);
    return;
  }
  lost("connection closed by the peer", 0);
}

// ---------------------------------------------------------------- failure

void Pair::fail_all(const std::shared_ptr<const Error>& err, std::vector<RequestPtr>* failed) {
  auto fail = [&](const RequestPtr& r) {
    if (r && r->pending()) {
      r->state = Request::State::kFailed;
      r->error = err;
      failed->push_back(r);
    }
  };
  for (auto& kv : posted_) fail(kv.second);
  for (auto& kv : unexpected_) fail(kv.second.waiting);
  for (auto& c : conns_) {
    for (auto& item : c.sendq) fail(item.req);
    c.sendq.clear();
    queued_ = 0;
    c.target.reset();
    c.unexpected = nullptr;
  }
  posted_.clear();
  size_t held = 0;
  for (auto& kv : unexpected_) held += kv.second.first.total;
  unexpected_.clear();
  if (held) host_.release_unexpected(held);
  close();
}

void Pair::close() {
  for (auto& c : conns_) {
    if (c.fd.valid()) ::shutdown(c.fd.get(), SHUT_RDWR);
    c.fd.reset();
  }
}

RequestPtr Pair::oldest_pending(Channel chan) const {
  RequestPtr best;
  auto consider = [&](const RequestPtr& r) {
    if (r && r->pending() && r->key.chan == chan && (!best || r->post_order < best->post_order)) {
      best = r;
    }
  };
  for (auto& kv : posted_) consider(kv.second);
  for (auto& kv : unexpected_) consider(kv.second.waiting);
  for (auto& c : conns_) {
    for (auto& item : c.sendq) consider(item.req);
  }
  return best;
}

std::vector<FrameHeader> Pair::unexpected_collective_headers() const {
  std::vector<FrameHeader> out;
  for (auto& kv : unexpected_) {
    if (kv.first.chan == Channel::kCollective) out.push_back(kv.second.first);
  }
  return out;
}

bool Pair::has_pending_send(Channel chan) const {
  for (auto& c : conns_) {
    for (auto& item : c.sendq) {
      if (item.req && item.req->key.chan == chan) return true;
    }
  }
  return false;
}

bool Pair::has_pending() const {
  if (!posted_.empty()) return true;
  for (auto& kv : unexpected_) {
    if (kv.second.waiting) return true;
  }
  for (auto& c : conns_) {
    if (!c.sendq.empty()) return true;
  }
  return false;
}

}  // namespace mccl
