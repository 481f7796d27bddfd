// The link to one peer: construction, the send half, control frames and failure.
// The receive half is in pair_recv.cc.
#include "transport/pair.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

namespace mccl {

namespace {

constexpr size_t kStageBytes = 64 << 10;  // per-socket receive staging buffer

// Stripe s of a message of n bytes cut into `stripes` starts here: whole units of
// kStripeAlign, so a receiver's sink that takes a stripe as it arrives never sees a split unit.
size_t stripe_begin(size_t n, size_t stripes, size_t s) {
  if (s == stripes) return n;
  const size_t units = n / Pair::kStripeAlign;
  return units * s / stripes * Pair::kStripeAlign;
}

}  // namespace

Pair::Pair(PairHost& host, int peer_rank, std::string peer_addr, uint64_t comm_id,
           std::vector<Fd> fds, const std::vector<FrameKeys>& keys, WireSecurity mode)
    : host_(host),
      peer_rank_(peer_rank),
      peer_addr_(std::move(peer_addr)),
      comm_id_(comm_id),
      sealed_(!keys.empty() && mode != WireSecurity::kOff) {
  conns_.resize(fds.size());
  for (size_t i = 0; i < fds.size(); ++i) {
    conns_[i].fd = std::move(fds[i]);
    conns_[i].rbuf.resize(kStageBytes);
    if (!sealed_) continue;
    // Nonces are (stream, record number) per key: one key for both directions would seal
    // the two sides' first records under the same nonce.
    if (std::memcmp(keys[i].send, keys[i].recv, kMacKeyBytes) == 0) {
      throw_error(ErrorKind::kConfig, "[engine] the two directions of socket " + std::to_string(i) + " to " +
                                          who() + " were given the same key; give each direction its own");
    }
    conns_[i].sealer = std::make_unique<RecordCipher>(mode, keys[i].send, true);
    conns_[i].opener = std::make_unique<RecordCipher>(mode, keys[i].recv, false);
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
    // A lent socket is mid-payload, so no ABORT frame can be next on it.
    while (conns_[i].fd.valid() && !conns_[i].lent) {
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
    size_t off = stripe_begin(n, stripes, s);
    size_t len = stripe_begin(n, stripes, s + 1) - off;
    FrameHeader h;
    h.kind = req->key.chan == Channel::kP2P ? FrameKind::kP2P : FrameKind::kCollective;
    h.comm_id = comm_id_;
    h.seq = req->key.seq;
    h.tag = req->key.tag;
    h.offset = off;
    h.length = len;
    h.total = n;
    h.sig = req->sig;
    SendItem item;
    item.req = req;
    encode_header(h, item.header);
    item.payload = req->buf + off;
    item.length = len;
    item.body = sealed_ ? sealed_bytes(len) : len;
    if (sealed_) item.header_len = kFrameHeaderBytes + kTagBytes;
    // Sealed frames of more than one record go to the send thread even when small. Written
    // inline, each is sealed whole by the caller before its first byte goes and the next
    // stripe's after it (a ring step's two 256 KiB stripes at 16 MB: ~64 us of AES-GCM each
    // on one core), while the caller, the thread that runs the algorithm, handles no other
    // segment; the send thread seals a record of each socket's frame in turn and writes it
    // at once (claim_seal). Wake-ups cost little beside the sealing of 128 KiB or more.
    const bool may_inline = !sealed_ || len <= kRecordBytes;
    enqueue(first_conn + s, std::move(item), may_inline);
  }
}

void Pair::enqueue(size_t conn, SendItem&& item, bool may_inline) {
  Conn& c = conns_[conn];
  if (!c.fd.valid()) lost("link already closed", 0);
  std::vector<SentFrame> sent;
  int err = 0;
  {
    auto lk = send_lock();
    // An empty queue means nobody is writing to this socket, so this thread may.
    const bool was_idle = c.sendq.empty();
    const bool inline_write = !writer_running() || (may_inline && item.length < kInlineBytes);
    if (queued_ == 0) touch_write();  // a stall counts from the first queued send
    ++queued_;
    c.sendq.push_back(std::move(item));
    if (was_idle && inline_write) err = write_queued(conn, &sent);  // most small sends end here
    if (writer_running() && !c.sendq.empty()) writer_->notify_locked();
  }
  for (const SentFrame& f : sent) on_sent(f);
  if (err) lost("send failed", err);
}

int Pair::gather_iov(size_t conn, iovec* iov) const {
  const Conn& c = conns_[conn];
  int cnt = 0;
  for (auto it = c.sendq.begin(); it != c.sendq.end() && cnt + 3 <= kMaxIov; ++it) {
    if (sealed_ && it->sealed == 0) break;  // its header's tag is not there yet
    if (it->header_sent < it->header_len) {
      iov[cnt++] = {const_cast<uint8_t*>(it->header) + it->header_sent, it->header_len - it->header_sent};
    }
    if (!sealed_) {
      if (it->sent < it->length) {
        iov[cnt++] = {const_cast<uint8_t*>(it->payload) + it->sent, it->length - it->sent};
      }
      continue;
    }
    // Sealed records, each its ciphertext (kMac: the payload itself) and then its tag.
    const size_t wire_record = kRecordBytes + kTagBytes;
    size_t pos = it->sent;
    for (size_t i = pos / wire_record; i + 1 < it->sealed && cnt + 2 <= kMaxIov; ++i) {
      const size_t off = pos - i * wire_record;
      const size_t rl = record_len(it->length, i);
      if (off < rl) {
        const uint8_t* src = c.sealer->encrypts() ? stage_slot(const_cast<SendItem&>(*it), i)
                                                  : it->payload + i * kRecordBytes;
        iov[cnt++] = {const_cast<uint8_t*>(src) + off, rl - off};
      }
      const size_t toff = off > rl ? off - rl : 0;
      iov[cnt++] = {const_cast<uint8_t*>(it->tags[i % kSealAhead]) + toff, kTagBytes - toff};
      pos = (i + 1) * wire_record;
    }
    if (pos < it->body) break;  // the rest of this frame is not sealed yet
  }
  return cnt;
}

void Pair::advance(size_t conn, size_t written, std::vector<SentFrame>* sent) {
  Conn& c = conns_[conn];
  if (written > 0) touch_write();
  size_t left = written;
  while (!c.sendq.empty()) {
    SendItem& it = c.sendq.front();
    size_t h = std::min(left, it.header_len - it.header_sent);
    it.header_sent += h;
    left -= h;
    size_t p = std::min(left, it.body - it.sent);
    it.sent += p;
    left -= p;
    if (it.header_sent < it.header_len || it.sent < it.body) break;
    sent->push_back({this, std::move(it.req), it.length});
    if (it.stage && records_of(it.length) > 1 && c.spare_stages.size() < 2) {
      c.spare_stages.push_back(std::move(it.stage));
    }
    c.sendq.pop_front();
    --queued_;
  }
}

void Pair::on_sent(const SentFrame& f) {
  if (!f.req) return;
  bytes_sent_.fetch_add(f.length, std::memory_order_relaxed);
  const RequestPtr& req = f.req;
  if (req->pending() && --req->parts_left == 0) {
    req->done = req->size;
    req->state = Request::State::kDone;
    host_.request_done(req);
  }
}

int Pair::write_queued(size_t conn, std::vector<SentFrame>* sent) {
  Conn& c = conns_[conn];
  while (!c.sendq.empty()) {
    SealJob jobs[kMaxSealJobs];
    const int n = claim_seal(conn, jobs);
    seal(jobs, n);
    commit_seal(jobs, n);
    iovec iov[kMaxIov];
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = gather_iov(conn, iov);
    ssize_t w = ::sendmsg(c.fd.get(), &msg, nosignal_flag() | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
      return errno;
    }
    advance(conn, static_cast<size_t>(w), sent);
  }
  return 0;
}

void Pair::flush(size_t conn) {
  std::vector<SentFrame> sent;
  int err = write_queued(conn, &sent);
  for (const SentFrame& f : sent) on_sent(f);
  if (err) lost("send failed", err);
}

void Pair::on_writable(size_t conn) {
  if (conns_[conn].fd.valid()) flush(conn);
}

void Pair::send_control(const FrameHeader& h, const std::string& payload, Deadline deadline) {
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
      const std::string bytes = control_frame(c, h, payload);
      write_all(c.fd.get(), reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), deadline);
    } catch (const Error&) {
      // best effort: this socket is already broken
    }
  }
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
    c.lent = false;  // the transport halted the receive threads first
  }
  posted_.clear();
  for (auto& kv : unexpected_) {
    host_.release_unexpected(std::move(kv.second.data), kv.second.capacity, kv.second.first.total);
  }
  unexpected_.clear();
  close();
}

void Pair::close() {
  for (auto& c : conns_) {
    if (c.fd.valid()) ::shutdown(c.fd.get(), SHUT_RDWR);
    c.fd.reset();
  }
}

RequestPtr Pair::oldest_pending(Channel chan) const {
  auto lk = send_lock();
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
  auto lk = send_lock();
  for (auto& c : conns_) {
    for (auto& item : c.sendq) {
      if (item.req && item.req->key.chan == chan) return true;
    }
  }
  return false;
}

bool Pair::has_pending() const {
  if (!posted_.empty()) return true;
  auto lk = send_lock();
  for (auto& kv : unexpected_) {
    if (kv.second.waiting) return true;
  }
  for (auto& c : conns_) {
    if (!c.sendq.empty()) return true;
  }
  return false;
}

}  // namespace mccl
