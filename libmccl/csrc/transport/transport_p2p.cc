// Point-to-point matching. A send to (peer, tag) carries the next number of that
// (peer, tag) sequence; a receive from a given peer takes the next number of its own
// counter, so messages match in the order they were posted on both sides whatever the
// socket they travel on. An any-source receive is bound to a peer only when a message
// that is next in that peer's sequence arrives (or is already buffered): the earliest
// such message wins.
#include "transport/transport.h"

namespace mccl {

namespace {

uint64_t p2p_slot(int peer, uint32_t tag) { return uint64_t(uint32_t(peer)) << 32 | tag; }

}  // namespace

RequestPtr Transport::send_p2p(int peer, const void* buf, size_t n, uint32_t tag, DoneFn on_done) {
  return guarded([&] {
    check_peer(peer, "send");
    uint64_t seq = p2p_send_seq_[p2p_slot(peer, tag)]++;
    auto req = make_request(true, peer, buf, n, {Channel::kP2P, seq, tag});
    req->on_done = std::move(on_done);
    post(peer, req);
    return req;
  });
}

RequestPtr Transport::recv_p2p(int peer, void* buf, size_t n, uint32_t tag, DoneFn on_done) {
  return guarded([&] {
    RequestPtr req;
    if (peer >= 0) {
      check_peer(peer, "receive");
      uint64_t seq = p2p_recv_seq_[p2p_slot(peer, tag)]++;
      req = make_request(false, peer, buf, n, {Channel::kP2P, seq, tag});
      req->on_done = std::move(on_done);
      post(peer, req);
      any_source_dirty_ = true;  // the next message of (peer, tag) may now be claimable
    } else {
      req = make_request(false, -1, buf, n, {Channel::kP2P, 0, tag});
      req->on_done = std::move(on_done);
      any_source_[tag].push_back(req);
      any_source_dirty_ = true;
    }
    match_any_source();
    return req;
  });
}

RequestPtr Transport::claim_for_any_source(Pair& pair, const FrameHeader& h) {
  auto it = any_source_.find(h.tag);
  if (it == any_source_.end() || it->second.empty()) return nullptr;
  uint64_t& next = p2p_recv_seq_[p2p_slot(pair.peer_rank(), h.tag)];
  if (h.seq != next) return nullptr;  // an earlier message of this peer is still in flight
  RequestPtr req = std::move(it->second.front());
  it->second.pop_front();
  ++next;
  req->peer = pair.peer_rank();
  req->key = {Channel::kP2P, h.seq, h.tag};
  pair.add_posted(req);
  any_source_dirty_ = true;
  return req;
}

void Transport::match_any_source() {
  if (!any_source_dirty_) return;
  any_source_dirty_ = false;
  for (auto& kv : any_source_) {
    const uint32_t tag = kv.first;
    auto& waiting = kv.second;
    while (!waiting.empty()) {
      // The earliest buffered message that is next in its peer's sequence for this tag.
      Pair* best = nullptr;
      Unexpected* best_u = nullptr;
      for (auto& p : pairs_) {
        if (!p) continue;
        uint64_t next = p2p_recv_seq_[p2p_slot(p->peer_rank(), tag)];
        Unexpected* u = p->find_unexpected({Channel::kP2P, next, tag});
        if (u && (!best_u || u->arrival < best_u->arrival)) {
          best = p.get();
          best_u = u;
        }
      }
      if (!best) break;
      RequestPtr req = std::move(waiting.front());
      waiting.pop_front();
      uint64_t seq = p2p_recv_seq_[p2p_slot(best->peer_rank(), tag)]++;
      req->peer = best->peer_rank();
      req->key = {Channel::kP2P, seq, tag};
      best->take_unexpected(req->key, req);
    }
  }
}

bool Transport::has_pending_p2p() const {
  for (auto& kv : any_source_) {
    if (!kv.second.empty()) return true;
  }
  for (auto& p : pairs_) {
    if (p && p->oldest_pending(Channel::kP2P)) return true;
  }
  for (auto& waiting : unlinked_) {
    for (auto& r : waiting) {
      if (r->key.chan == Channel::kP2P) return true;
    }
  }
  return false;
}

void Transport::p2p_timeout(double timeout_s) {
  int peer = -1;
  std::string what = describe_stall(Channel::kP2P, &peer);
  Error e(ErrorKind::kTimeout,
          "[send/recv] Timed out after " + format_seconds(timeout_s) + " s waiting for " + what +
              "; likely cause: the peer never posted the matching recv/send or is stalled; "
              "check both sides issue matching calls",
          peer, peer >= 0 ? addrs_[peer] : "");
  fail(e);
  throw_if_failed();
  throw e;
}

}  // namespace mccl
