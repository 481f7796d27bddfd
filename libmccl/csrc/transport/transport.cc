#include "transport/transport.h"

#include <errno.h>
#include <poll.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace mccl {

Transport::Transport(int rank, int size, uint64_t comm_id, std::vector<std::vector<Fd>> links,
                     std::vector<std::string> addrs, bool send_thread, int recv_threads,
                     const std::vector<std::vector<FrameKeys>>& keys,
                     std::shared_ptr<const SignatureRules> rules, WireSecurity security)
    : rank_(rank),
      size_(size),
      comm_id_(comm_id),
      addrs_(std::move(addrs)),
      rules_(rules ? std::move(rules) : std::make_shared<OpaqueSignatureRules>()),
      security_(security) {
  pairs_.resize(size);
  unlinked_.resize(size);
  published_.reset(new std::atomic<Pair*>[size]);
  for (int r = 0; r < size; ++r) published_[r].store(nullptr);
  make_wake_pipe(&wake_read_, &wake_write_, "progress thread");
  if (size > 1 && recv_threads > 0) {
    for (int i = 0; i < recv_threads; ++i) {
      readers_.push_back(std::make_unique<RecvThread>([this] { wake(); }));
      reader_ptrs_.push_back(readers_.back().get());
    }
  }
  if (send_thread) writer_ = std::make_unique<SendThread>([this] { wake(); });
  for (int r = 0; r < size; ++r) {
    if (r == rank || links[r].empty()) continue;
    add_pair(r, std::move(links[r]), keys.empty() ? std::vector<FrameKeys>{} : keys[r]);
  }
  if (writer_) writer_->start({});  // it learned the pairs through add_pair
}

void Transport::add_pair(int peer, std::vector<Fd> fds, const std::vector<FrameKeys>& keys) {
  const int n = static_cast<int>(fds.size());
  pairs_[peer] = std::make_unique<Pair>(*this, peer, addrs_[peer], comm_id_, std::move(fds), keys,
                                        security_);
  Pair* p = pairs_[peer].get();
  if (!reader_ptrs_.empty()) p->use_readers(reader_ptrs_);
  if (writer_) {
    p->use_writer(writer_.get());
    writer_->add_pair(p);
  }
  published_[peer].store(p);
  linked_peers_.fetch_add(1, std::memory_order_relaxed);
  link_sockets_.fetch_add(n, std::memory_order_relaxed);
}

void Transport::use_linker(std::unique_ptr<LinkSource> source) {
  linker_ = std::move(source);
  linker_->on_event([this] { wake(); });
  wake();  // links that came up before this call wait in its queue
}

void Transport::post(int peer, const RequestPtr& req) {
  if (Pair* p = pairs_[peer].get()) {
    if (req->is_send) {
      p->post_send(req);
    } else {
      p->post_recv(req);
    }
    return;
  }
  if (!linker_) {
    throw_error(ErrorKind::kConfig,
                "[transport] no link to " + who(peer) +
                    ": this communicator runs on the sockets its owner handed in (mccld) and "
                    "none were handed in for that rank, which only the collectives' own peers "
                    "get; likely cause: an op that needs every peer (gather, scatter, "
                    "all-to-all, send/recv) on a communicator built that way; run it over the "
                    "engine's own links (MCCL_DAEMON=0)",
                peer, addrs_[peer]);
  }
  unlinked_[peer].push_back(req);
  if (req->is_send) linker_->want(peer);
}

void Transport::adopt_links() {
  if (!linker_) return;
  if (auto err = linker_->take_error()) throw Error(*err);
  std::vector<NewLink> links;
  linker_->take_ready(&links);
  for (NewLink& l : links) {
    if (pairs_[l.peer]) continue;  // cannot happen: a source hands each peer over once
    add_pair(l.peer, std::move(l.fds), l.keys);
    wipe(l.keys.data(), l.keys.size() * sizeof(FrameKeys));
    std::deque<RequestPtr> waiting;
    waiting.swap(unlinked_[l.peer]);
    for (const RequestPtr& req : waiting) post(l.peer, req);
    any_source_dirty_ = true;  // its buffered messages may match any-source receives
  }
}

Transport::~Transport() {
  if (linker_) linker_->stop();
  if (writer_) writer_->halt();
  for (auto& r : readers_) r->halt();
  for (auto& p : pairs_) {
    if (p) p->close();
  }
}

void Transport::stop_helpers() {
  if (linker_) linker_->stop();
  for (auto& p : pairs_) {
    if (p) {
      p->use_writer(nullptr);
      p->use_readers({});
    }
  }
  writer_.reset();   // halts and joins
  readers_.clear();  // likewise
}

std::string Transport::who(int r) const {
  return "peer=" + addrs_[r] + " (rank " + std::to_string(r) + ")";
}

void Transport::throw_if_failed() const {
  if (failed_) throw *failed_;
}

void Transport::check_peer(int peer, const char* what) const {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw_error(ErrorKind::kConfig, std::string("[transport] ") + what + " with invalid peer rank " +
                                        std::to_string(peer) + " (world size " +
                                        std::to_string(size_) + ", this rank " +
                                        std::to_string(rank_) + ")");
  }
}

RequestPtr Transport::make_request(bool is_send, int peer, const void* buf, size_t n,
                                   const MsgKey& key) {
  auto req = std::make_shared<Request>();
  req->is_send = is_send;
  req->peer = peer;
  req->buf = static_cast<uint8_t*>(const_cast<void*>(buf));
  req->size = n;
  req->key = key;
  req->post_order = ++post_counter_;
  return req;
}

// ---------------------------------------------------------------- collectives

RequestPtr Transport::isend(int peer, const void* buf, size_t n, uint32_t tag, uint64_t cookie) {
  return guarded([&] {
    check_peer(peer, "send");
    auto req = make_request(true, peer, buf, n, {Channel::kCollective, active_seq_, tag});
    req->sig = active_sig_;
    req->cookie = cookie;
    post(peer, req);
    return req;
  });
}

RequestPtr Transport::irecv(int peer, void* buf, size_t n, uint32_t tag, uint64_t cookie) {
  return irecv_sink(peer, buf, n, tag, nullptr, cookie);
}

RequestPtr Transport::irecv_sink(int peer, void* buf, size_t n, uint32_t tag,
                                 std::shared_ptr<const Sink> sink, uint64_t cookie) {
  return guarded([&] {
    check_peer(peer, "receive");
    if (sink && (sink->unit() == 0 || sink->unit() > Sink::kMaxUnit)) {
      throw_error(ErrorKind::kConfig, "[transport] a receive's sink takes " + std::to_string(sink->unit()) +
                                          "-byte units, the transport carries 1 to " +
                                          std::to_string(Sink::kMaxUnit) +
                                          "; likely cause: a bug in the caller's sink; please report it");
    }
    auto req = make_request(false, peer, buf, n, {Channel::kCollective, active_seq_, tag});
    req->sig = active_sig_;
    req->cookie = cookie;
    req->sink = std::move(sink);
    post(peer, req);
    return req;
  });
}

void Transport::begin_collective(uint64_t seq, const Signature& sig) {
  guarded([&] {
    active_ = true;
    active_seq_ = seq;
    active_sig_ = sig;
    active_start_ = Clock::now();
    grace_until_ = Deadline();
    first_heard_.assign(size_, Clock::time_point::max());
    tag_namer_ = nullptr;
    done_q_.clear();
    // Frames of this op that arrived before it started were only buffered: check them now.
    for (auto& p : pairs_) {
      if (!p) continue;
      for (const FrameHeader& h : p->unexpected_collective_headers()) {
        check_collective_frame(*p, h);
      }
    }
  });
}

void Transport::end_collective() {
  active_ = false;
  last_sig_ = active_sig_;
  next_coll_seq_ = active_seq_ + 1;
}

void Transport::check_collective_frame(Pair& pair, const FrameHeader& h) {
  if (active_ && h.seq == active_seq_) {
    compare_signature(pair, h, active_sig_);
    Clock::time_point& first = first_heard_[pair.peer_rank()];
    if (first == Clock::time_point::max()) first = Clock::now();
  } else if (next_coll_seq_ > 0 && h.seq == next_coll_seq_ - 1) {
    // A send-only op (a broadcast root) may finish before the disagreement shows.
    compare_signature(pair, h, last_sig_);
    compare_signature(pair, h, last_sig_, true);
  } else if (h.seq < next_coll_seq_ || (active_ && h.seq < active_seq_)) {
    throw_error(ErrorKind::kMismatch,
                "[" + rules_->name(h.sig) + "] " + pair.who() + " sent data for " +
                    rules_->name(h.sig) + " op #" + std::to_string(h.seq) +
                    ", which this rank has already finished; likely cause: ranks issue "
                    "collectives in different orders or counts; make every rank call the same "
                    "sequence",
                pair.peer_rank(), pair.peer_addr());
  }
}

void Transport::compare_signature(Pair& pair, const FrameHeader& h, const Signature& s,
                                  bool finished) const {
  const std::string opno = "op #" + std::to_string(h.seq);
  std::string why = finished ? pair.who() + " sent more data for " + opno +
                                   ", which this rank has already finished; likely cause: ranks "
                                   "disagree on the collective's arguments; every rank must call "
                                   "it with the same ones"
                             : rules_->mismatch(s, h.sig, pair.who(), opno);
  if (why.empty()) return;
  throw_error(ErrorKind::kMismatch, "[" + rules_->name(s) + "] " + why, pair.peer_rank(),
              pair.peer_addr());
}

RequestPtr Transport::wait_next(Deadline deadline, double timeout_s) {
  while (done_q_.empty()) {
    throw_if_failed();
    const auto now = Clock::now();
    if (now >= std::max(deadline, grace_until_)) {
      int peer = -1;
      bool sure = false;
      std::string waiting = describe_stall(Channel::kCollective, &peer, &sure);
      if (!sure && grace_until_ == Deadline()) {
        // The awaited peer did send us data in this op, so it may itself be waiting on
        // the culprit. Give a rank with firmer evidence a moment to say who (ABORT):
        // until that peer's own deadline has passed (it may have begun the op later
        // than we did: under load by more than the margin), then the margin for its word
        // to arrive; never more than one more timeout.
        const auto margin = std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(weak_evidence_margin_s(timeout_s)));
        Deadline theirs = now;
        if (peer >= 0 && first_heard_.size() == static_cast<size_t>(size_) &&
            first_heard_[peer] != Clock::time_point::max()) {
          theirs = std::max(now, first_heard_[peer] + std::chrono::duration_cast<Clock::duration>(
                                                          std::chrono::duration<double>(timeout_s)));
        }
        grace_until_ = std::min(theirs + margin, deadline_after(timeout_s));
        continue;
      }
      Error e(ErrorKind::kTimeout,
              "[" + rules_->name(active_sig_) + "] Timed out after " + format_seconds(timeout_s) +
                  " s in op #" + std::to_string(active_seq_) + " (" +
                  rules_->summary(active_sig_) + ") waiting for " + waiting +
                  "; likely cause: that rank is stalled (stopped, deadlocked, overloaded) or did "
                  "not call this collective; check it, or raise the process group timeout",
              peer, peer >= 0 ? addrs_[peer] : "");
      fail(e);
      throw_if_failed();
    }
    progress(std::max(deadline, grace_until_));
  }
  RequestPtr r = std::move(done_q_.front());
  done_q_.pop_front();
  return r;
}

std::string Transport::describe_stall(Channel chan, int* peer, bool* sure) const {
  // A peer that stopped reading (our send to it makes no progress) is the strongest
  // suspect: a rank merely waiting for data may itself be waiting on someone else.
  const auto now = Clock::now();
  const Pair* stalled = nullptr;
  for (auto& p : pairs_) {
    if (p && p->has_pending_send(chan) && now - p->last_write() > std::chrono::seconds(1) &&
        (!stalled || p->last_write() < stalled->last_write())) {
      stalled = p.get();
    }
  }
  if (stalled) {
    if (sure) *sure = true;
    *peer = stalled->peer_rank();
    double idle = std::chrono::duration<double>(now - stalled->last_write()).count();
    return "sending to " + stalled->who() + ", which has not read anything for " +
           format_seconds(idle) + " s";
  }
  RequestPtr oldest;
  for (auto& p : pairs_) {
    if (!p) continue;
    RequestPtr r = p->oldest_pending(chan);
    if (r && (!oldest || r->post_order < oldest->post_order)) oldest = r;
  }
  for (auto& waiting : unlinked_) {
    for (const RequestPtr& r : waiting) {
      if (r->key.chan == chan && (!oldest || r->post_order < oldest->post_order)) oldest = r;
    }
  }
  if (oldest && !pairs_[oldest->peer]) {
    // No link yet: nothing of this op can have come from that peer.
    if (sure) *sure = true;
    *peer = oldest->peer;
    const bool dialing = oldest->is_send;
    return "a link to " + who(oldest->peer) + ", " +
           (dialing && linker_ ? linker_->missing_link()
                               : "which never connected to this rank to send its data") +
           " (" + (chan == Channel::kCollective && tag_namer_ ? tag_namer_(oldest->key.tag)
                                                               : "message tag " +
                                                                     std::to_string(oldest->key.tag)) +
           ")";
  }
  if (!oldest) {
    bool any = false;
    for (auto& kv : any_source_) any = any || !kv.second.empty();
    return any && chan == Channel::kP2P ? "an any-source receive" : "nothing";
  }
  *peer = oldest->peer;
  // Sure if that peer sent nothing at all since this op began.
  if (sure) *sure = active_ && pairs_[oldest->peer]->last_read() < active_start_;
  return std::string(oldest->is_send ? "sending to " : "data from ") + who(oldest->peer) +
         " (" + (chan == Channel::kCollective && tag_namer_ ? tag_namer_(oldest->key.tag)
                                                              : "message tag " +
                                                                    std::to_string(oldest->key.tag)) +
         ")";
}

// ---------------------------------------------------------------- progress

void Transport::request_done(const RequestPtr& req) {
  if (req->on_done) {
    req->on_done(*req);
  } else {
    done_q_.push_back(req);
  }
}

std::unique_ptr<uint8_t[]> Transport::reserve_unexpected(Pair& pair, const FrameHeader& h,
                                                         size_t* capacity) {
  if (unexpected_bytes_ + h.total > kMaxUnexpectedBytes) {
    throw_error(ErrorKind::kMismatch,
                "[transport] " + pair.who() + " sent a " + std::to_string(h.total) + "-byte " +
                    (h.kind == FrameKind::kCollective ? rules_->name(h.sig)
                                                      : std::string(frame_kind_name(h.kind))) +
                    " message nobody asked for yet, beyond the " +
                    std::to_string(kMaxUnexpectedBytes >> 20) +
                    " MiB this rank buffers; likely cause: sends without matching receives, or "
                    "ranks running different collectives; post the matching recv first",
                pair.peer_rank(), pair.peer_addr());
  }
  unexpected_bytes_ += h.total;
  unexpected_count_.fetch_add(1, std::memory_order_relaxed);
  unexpected_total_.fetch_add(h.total, std::memory_order_relaxed);
  const size_t want = std::max<size_t>(h.total, 1);
  auto it = spare_buffers_.lower_bound(want);
  if (it != spare_buffers_.end() && it->first <= 2 * want) {
    *capacity = it->first;
    spare_bytes_ -= it->first;
    std::unique_ptr<uint8_t[]> buf = std::move(it->second);
    spare_buffers_.erase(it);
    return buf;
  }
  *capacity = want;
  return std::unique_ptr<uint8_t[]>(new uint8_t[want]);
}

void Transport::release_unexpected(std::unique_ptr<uint8_t[]> buf, size_t capacity, size_t bytes) {
  unexpected_bytes_ -= bytes;
  if (!buf || spare_bytes_ + capacity > kMaxSpareBytes) return;  // freed here
  spare_bytes_ += capacity;
  spare_buffers_.emplace(capacity, std::move(buf));
}

void Transport::wake() {
  if (!wake_pending_.exchange(true)) {
    char b = 1;
    ssize_t rc = ::write(wake_write_.get(), &b, 1);
    (void)rc;  // a full pipe already guarantees a wake-up
  }
}

void Transport::request_abort(const Error& reason) {
  {
    std::lock_guard<std::mutex> lk(abort_mu_);
    if (!abort_reason_) abort_reason_ = std::make_unique<Error>(reason);
  }
  abort_requested_.store(true);
  wake();
}

void Transport::progress(Deadline until) {
  throw_if_failed();
  if (abort_requested_.load()) {
    Error e = [&] {
      std::lock_guard<std::mutex> lk(abort_mu_);
      return *abort_reason_;
    }();
    fail(e);
    throw_if_failed();
  }
  guarded([&] {
    adopt_links();
    match_any_source();
    // Rebuilt each round (a handful of sockets): the set shrinks as links close.
    std::vector<pollfd>& fds = poll_fds_;
    std::vector<std::pair<Pair*, size_t>>& owner = poll_owner_;
    fds.clear();
    owner.clear();
    fds.push_back({wake_read_.get(), POLLIN, 0});
    owner.push_back({nullptr, 0});
    for (auto& p : pairs_) {
      if (!p) continue;
      for (size_t i = 0; i < p->num_conns(); ++i) {
        if (!p->conn_open(i)) continue;
        short ev = p->conn_wants_read(i) ? POLLIN : 0;
        if (p->conn_wants_write(i)) ev |= POLLOUT;
        if (!ev) continue;
        fds.push_back({p->conn_fd(i), ev, 0});
        owner.push_back({p.get(), i});
      }
    }
    int n = ::poll(fds.data(), fds.size(), ms_until(until, 1000));
    if (n < 0) {
      if (errno == EINTR) return;
      throw_error(ErrorKind::kGeneric, std::string("[transport] poll failed: ") +
                                           std::strerror(errno));
    }
    if (n == 0) return;
    if (fds[0].revents) {
      // wake() writes at most one byte until we clear wake_pending_: one read drains it.
      char buf[64];
      ssize_t rc = ::read(wake_read_.get(), buf, sizeof(buf));
      (void)rc;
      wake_pending_.store(false);
    }
    collect_sent();
    collect_received();
    for (size_t i = 1; i < fds.size(); ++i) {
      short re = fds[i].revents;
      if (!re) continue;
      Pair* p = owner[i].first;
      size_t c = owner[i].second;
      if (re & POLLOUT) p->on_writable(c);
      if (re & (POLLIN | POLLHUP | POLLERR)) p->on_readable(c);
    }
    match_any_source();
  });
  if (abort_requested_.load()) progress(Clock::now());  // surfaces the abort right away
}

void Transport::collect_sent() {
  if (!writer_) return;
  Pair* broken = nullptr;
  int err = 0;
  const bool write_failed = writer_->take_error(&broken, &err);
  complete_sent();
  if (write_failed) {
    writer_->halt();
    broken->send_failed(err);  // throws PeerLost; progress() fails the transport with it
  }
}

void Transport::halt_writer() {
  if (!writer_) return;
  writer_->halt();
  complete_sent();
}

void Transport::collect_received() {
  for (auto& reader : readers_) {
    reader->take_done(&recv_scratch_);
    for (const RecvDone& d : recv_scratch_) d.pair->on_returned(d);
    recv_scratch_.clear();
  }
}

void Transport::halt_readers() {
  for (auto& r : readers_) r->halt();
  recv_scratch_.clear();
}

void Transport::complete_sent() {
  writer_->take_sent(&sent_scratch_);
  for (const SentFrame& f : sent_scratch_) f.pair->on_sent(f);
  sent_scratch_.clear();
}

// ---------------------------------------------------------------- failure

void Transport::fail(const Error& cause) {
  if (failed_) return;
  if (linker_) linker_->stop();  // no link is adopted by a failed transport
  // From here on this thread alone writes (ABORT frames); frames already written still
  // complete their requests normally. Nothing reads into the receives failed below.
  halt_writer();
  halt_readers();
  Error e = cause;
  auto* remote = dynamic_cast<const RemoteAbort*>(&cause);
  if (remote && cause.kind() == ErrorKind::kTimeout && cause.peer_rank() == rank_) {
    // Another rank gave up waiting for this one, but this one was itself waiting on
    // somebody: report (and pass on) that rank rather than blaming ourselves.
    int peer = -1;
    std::string stall = describe_stall(active_ ? Channel::kCollective : Channel::kP2P, &peer);
    if (peer >= 0 && peer != remote->origin()) {
      e = Error(ErrorKind::kTimeout,
                "[transport] Timed out: rank " + std::to_string(remote->origin()) +
                    " gave up waiting for this rank, which was itself waiting for " + stall +
                    "; likely cause: that rank is stalled (stopped, deadlocked, overloaded) or "
                    "did not call the same collective; check it, or raise the timeout",
                peer, addrs_[peer]);
      remote = nullptr;
    }
  }
  failed_ = std::make_shared<const Error>(e);
  AbortInfo info;
  info.origin_rank = rank_;
  info.lost_rank = e.peer_rank();
  info.kind = static_cast<int32_t>(e.kind());
  info.lost_addr = e.peer_addr();
  info.message = e.what();
  if (remote) {
    info.origin_rank = remote->origin();
    info.message = remote->original_message();
  }
  FrameHeader h;
  h.kind = FrameKind::kAbort;
  h.comm_id = comm_id_;
  std::string payload = encode_abort(info);
  h.length = h.total = payload.size();
  // Tell every live peer first, so survivors report the original cause rather than
  // "connection closed" by us. Bounded: a stalled peer must not hold up the failure.
  Deadline deadline = Clock::now() + std::chrono::milliseconds(200);
  for (auto& p : pairs_) {
    if (!p) continue;
    if (e.kind() == ErrorKind::kPeerLost && p->peer_rank() == e.peer_rank()) continue;
    p->send_control(h, payload, deadline);
  }
  std::vector<RequestPtr> failed;
  for (auto& p : pairs_) {
    if (p) p->fail_all(failed_, &failed);
  }
  for (auto& kv : any_source_) {
    for (auto& r : kv.second) {
      r->state = Request::State::kFailed;
      r->error = failed_;
      failed.push_back(r);
    }
  }
  any_source_.clear();
  for (auto& waiting : unlinked_) {
    for (auto& r : waiting) {
      r->state = Request::State::kFailed;
      r->error = failed_;
      failed.push_back(r);
    }
    waiting.clear();
  }
  done_q_.clear();
  for (auto& r : failed) {
    if (r->on_done) r->on_done(*r);
  }
}

void Transport::close_gracefully(Deadline deadline) {
  if (linker_) linker_->stop();
  halt_writer();  // every op has ended: nothing is queued but what BYE may need
  halt_readers();
  if (!failed_) {
    FrameHeader h;
    h.kind = FrameKind::kBye;
    h.comm_id = comm_id_;
    for (auto& p : pairs_) {
      if (p) p->send_control(h, std::string(), deadline);
    }
  }
  for (auto& p : pairs_) {
    if (p) p->close();
  }
}

uint64_t Transport::bytes_sent(int peer) const {
  Pair* p = published_[peer].load();
  return p ? p->bytes_sent() : 0;
}

uint64_t Transport::bytes_received(int peer) const {
  Pair* p = published_[peer].load();
  return p ? p->bytes_received() : 0;
}

}  // namespace mccl
