// All links of one communicator and its progress engine.
//
// MPI-style progress: the thread that runs the algorithms drives the nonblocking
// sockets itself while it waits (wait_next/progress): it parses, matches and completes
// everything. Only the copying of bulk bytes is left to other threads, which hand
// finished frames and errors back to this one: a send thread writes bulk frames into the
// sockets (send_thread.h), receive threads read bulk payloads out of them and hand
// them to the receive's sink where it has one (recv_thread.h). Every wait
// polls every peer's sockets, so a peer that dies is noticed at once by every rank, not
// only by its ring neighbours. A failure (lost peer, timeout, mismatch, local abort) is
// sticky: every pending request fails with it, live peers get an ABORT frame naming
// the original culprit, and all sockets are closed.
//
// Links on demand: a peer without a link has no Pair yet. Requests posted to it wait in
// the transport (unlinked_) in post order; a send asks the link source (link_source.h: the
// Linker dials it, linker.h; HandedLinks asks the owner for sockets, handed_links.h), a
// receive waits for the sender's link. Each progress round adopts the links the source
// finished (a Pair, registered with the send and receive threads) and posts what waited.
// Without a source (links built on borrowed sockets only) an op to an unlinked peer fails
// with a ConfigError naming it.
//
// Thread safety: everything runs on the owning (worker) thread except wake(),
// request_abort(), the byte and link counters, the send thread's socket writes and the
// receive threads' reads of lent sockets.
#pragma once
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/linker.h"
#include "transport/pair.h"
#include "transport/recv_thread.h"
#include "transport/request.h"
#include "transport/send_thread.h"
#include "transport/socket.h"

namespace mccl {

class Transport : public PairHost {
 public:
  // Unexpected (not yet received-for) bytes a rank buffers before it declares a mismatch.
  static constexpr uint64_t kMaxUnexpectedBytes = uint64_t(1) << 30;
  // Freed unexpected-message buffers kept for reuse, at most this many bytes.
  static constexpr size_t kMaxSpareBytes = 64 << 20;

  // send_thread: bulk frames are written by a SendThread (else by this thread, in progress).
  // recv_threads: that many RecvThreads read bulk payloads (0: this thread reads all).
  // links[peer]: its sockets, or empty: no link yet (linked later, see use_linker).
  // keys: empty (bare frames), or keys[peer] with one FrameKeys per socket of links[peer];
  // security: what they do, kMac or kAead (pair.h).
  // rules: what collective signatures mean (signature.h); null: compared as bytes.
  Transport(int rank, int size, uint64_t comm_id, std::vector<std::vector<Fd>> links,
            std::vector<std::string> addrs, bool send_thread, int recv_threads,
            const std::vector<std::vector<FrameKeys>>& keys = {},
            std::shared_ptr<const SignatureRules> rules = nullptr,
            WireSecurity security = WireSecurity::kAead);
  ~Transport() override;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // Links to peers without one come from `source` from now on (woken by it).
  void use_linker(std::unique_ptr<LinkSource> source);
  // Peers linked now, and their sockets (any thread).
  int linked_peers() const { return linked_peers_.load(std::memory_order_relaxed); }
  int link_sockets() const { return link_sockets_.load(std::memory_order_relaxed); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& addr(int r) const { return addrs_[r]; }
  std::string who(int r) const;  // "peer=host:port (rank r)"

  // Collective traffic. Completions are queued for wait_next().
  RequestPtr isend(int peer, const void* buf, size_t n, uint32_t tag, uint64_t cookie = 0);
  RequestPtr irecv(int peer, void* buf, size_t n, uint32_t tag, uint64_t cookie = 0);
  // A receive whose payload is handed to `sink` (with its place in buf, sink.h) as it
  // arrives, on whichever thread reads it; null: stored in buf, as irecv does.
  RequestPtr irecv_sink(int peer, void* buf, size_t n, uint32_t tag, std::shared_ptr<const Sink> sink,
                        uint64_t cookie = 0);
  // Frames of collective `seq` are checked against `sig` (opaque to the transport, judged
  // by the rules) as they arrive.
  void begin_collective(uint64_t seq, const Signature& sig);
  // How the running collective's algorithm names a tag ("all-gather step 2, segment 5"),
  // for timeout messages.
  void set_tag_namer(std::function<std::string(uint32_t)> namer) { tag_namer_ = std::move(namer); }
  void end_collective();
  // Drives I/O until one of the running collective's requests completes. At the
  // deadline it fails the transport with CollectiveTimeout naming the awaited peer.
  RequestPtr wait_next(Deadline deadline, double timeout_s);
  // Past an op's deadline with only weak evidence (the awaited peer did send in this op),
  // wait_next waits this much longer for a rank with firmer evidence to name the culprit.
  static double weak_evidence_margin_s(double timeout_s) {
    return std::min(std::max(0.25 * timeout_s, 0.2), 5.0);
  }
  bool has_completion() const { return !done_q_.empty(); }  // wait_next would return at once

  // Point-to-point. `on_done` runs on this thread when the request completes or fails.
  using DoneFn = std::function<void(Request&)>;
  RequestPtr send_p2p(int peer, const void* buf, size_t n, uint32_t tag, DoneFn on_done);
  RequestPtr recv_p2p(int peer, void* buf, size_t n, uint32_t tag, DoneFn on_done);  // peer -1: any
  bool has_pending_p2p() const;
  // Fails the transport with CollectiveTimeout describing the oldest pending p2p request.
  [[noreturn]] void p2p_timeout(double timeout_s);

  // One round of I/O: returns after handling events, at `until`, or when woken.
  void progress(Deadline until);
  void wake();                              // any thread
  void request_abort(const Error& reason);  // any thread: next progress fails with it
  bool abort_requested() const { return abort_requested_.load(); }

  // Idempotent. Tells live peers (ABORT), fails everything pending, closes the links.
  void fail(const Error& e);
  std::shared_ptr<const Error> failure() const { return failed_; }
  // Orderly close: BYE on every socket so peers do not mistake the EOF for a crash.
  void close_gracefully(Deadline deadline);
  // For borrowed sockets (transport/release.cc): BYE both ways on every socket, then close
  // only our dups. True if every stream ended exactly at the peer's BYE, so the sockets can
  // carry another communicator; on false they were shut down (both owners discard them).
  bool release(Deadline deadline);
  // The owner thread is done with the transport (the communicator's worker has exited):
  // joins the send and receive threads and closes their wake pipes now, rather than when
  // the last reference to the communicator goes (in mccld a failed job's error could keep
  // one alive until a full GC: 3 threads and 8 pipe fds a job). Idempotent.
  void stop_helpers();

  // Messages (and their bytes) that arrived before their receive was posted and had to
  // be buffered and copied: a measure of how far peers run ahead.
  uint64_t unexpected_messages() const { return unexpected_count_.load(std::memory_order_relaxed); }
  uint64_t unexpected_bytes() const { return unexpected_total_.load(std::memory_order_relaxed); }
  uint64_t bytes_sent(int peer) const;
  uint64_t bytes_received(int peer) const;

  // PairHost
  void request_done(const RequestPtr& req) override;
  void check_collective_frame(Pair& pair, const FrameHeader& h) override;
  RequestPtr claim_for_any_source(Pair& pair, const FrameHeader& h) override;
  std::unique_ptr<uint8_t[]> reserve_unexpected(Pair& pair, const FrameHeader& h,
                                                size_t* capacity) override;
  void release_unexpected(std::unique_ptr<uint8_t[]> buf, size_t capacity, size_t bytes) override;
  uint64_t next_arrival() override { return ++arrivals_; }
  std::string op_name(const Signature& sig) const override { return rules_->name(sig); }

 private:
  RequestPtr make_request(bool is_send, int peer, const void* buf, size_t n, const MsgKey& key);
  // Posts to the peer's Pair, or queues it until the link is up (see the file comment).
  void post(int peer, const RequestPtr& req);
  void add_pair(int peer, std::vector<Fd> fds, const std::vector<FrameKeys>& keys);
  // The source's finished links become Pairs; its failure throws.
  void adopt_links();
  void check_peer(int peer, const char* what) const;
  // Throws CollectiveMismatch if `h` disagrees with `s` (or unconditionally if `finished`).
  void compare_signature(Pair& pair, const FrameHeader& h, const Signature& s,
                         bool finished = false) const;
  void match_any_source();  // pairs waiting any-source receives with buffered messages
  void throw_if_failed() const;
  // Completes the frames the send thread wrote; fails the link its write failed on.
  void collect_sent();
  // Stops the send thread's writing for good (failure, shutdown); completes what it wrote.
  void halt_writer();
  void complete_sent();  // the frames the send thread has written
  // Takes back the sockets the receive threads finished reading; their errors throw.
  void collect_received();
  // Stops the receive threads' reading for good (failure, shutdown, release).
  void halt_readers();
  // Who this rank is most likely stuck on, for timeout messages; sets *peer.
  // *sure (if given): the evidence is firm (the peer stopped reading, or sent nothing
  // during this op) rather than "it has not sent the next piece yet".
  std::string describe_stall(Channel chan, int* peer, bool* sure = nullptr) const;
  // Runs f; an Error from the links fails the transport (telling peers) and is rethrown
  // as the transport's failure, which may be an earlier one.
  template <typename F>
  auto guarded(F&& f) -> decltype(f()) {
    throw_if_failed();
    try {
      return f();
    } catch (const Error& e) {
      fail(e);
      throw_if_failed();
      throw;
    }
  }

  const int rank_;
  const int size_;
  const uint64_t comm_id_;
  std::vector<std::string> addrs_;
  std::shared_ptr<const SignatureRules> rules_;
  const WireSecurity security_;
  std::vector<std::unique_ptr<Pair>> pairs_;  // null at index rank_ and for unlinked peers
  // pairs_ for other threads (byte counters): set once a pair exists, never cleared.
  std::unique_ptr<std::atomic<Pair*>[]> published_;
  std::vector<std::deque<RequestPtr>> unlinked_;  // by peer: posted before its link is up
  std::atomic<int> linked_peers_{0};
  std::atomic<int> link_sockets_{0};

  std::deque<RequestPtr> done_q_;
  uint64_t post_counter_ = 0;
  uint64_t arrivals_ = 0;
  uint64_t unexpected_bytes_ = 0;  // buffered right now
  // Freed unexpected buffers by capacity, reused by later ones: a peer that runs ahead
  // makes this happen every op, and fresh multi-MB allocations fault in every page.
  std::multimap<size_t, std::unique_ptr<uint8_t[]>> spare_buffers_;
  size_t spare_bytes_ = 0;
  std::atomic<uint64_t> unexpected_count_{0};
  std::atomic<uint64_t> unexpected_total_{0};

  bool active_ = false;
  uint64_t active_seq_ = 0;
  uint64_t next_coll_seq_ = 0;  // every collective seq below this one has finished here
  Signature active_sig_{};
  Signature last_sig_{};  // of the collective next_coll_seq_ - 1
  Clock::time_point active_start_;
  Deadline grace_until_;  // set once the op deadline passed with only weak evidence
  // When each peer's first frame of the running collective arrived (max: none yet): that
  // peer began the op no later, so its own deadline is no later than this + the timeout.
  std::vector<Clock::time_point> first_heard_;
  std::function<std::string(uint32_t)> tag_namer_;

  std::unordered_map<uint64_t, uint64_t> p2p_send_seq_;  // (peer, tag) -> next seq
  std::unordered_map<uint64_t, uint64_t> p2p_recv_seq_;
  std::unordered_map<uint32_t, std::deque<RequestPtr>> any_source_;  // tag -> receives
  bool any_source_dirty_ = false;

  std::shared_ptr<const Error> failed_;
  std::vector<struct pollfd> poll_fds_;  // scratch of progress(), kept to avoid allocations
  std::vector<std::pair<Pair*, size_t>> poll_owner_;

  Fd wake_read_, wake_write_;
  std::atomic<bool> wake_pending_{false};
  std::atomic<bool> abort_requested_{false};
  std::mutex abort_mu_;
  std::unique_ptr<Error> abort_reason_;
  std::vector<SentFrame> sent_scratch_;
  std::vector<RecvDone> recv_scratch_;
  // Last: it writes from the pairs' queues, so it must stop (halt()) before they go.
  // Null when the owner thread writes everything itself.
  std::unique_ptr<SendThread> writer_;
  // Likewise, they read into the pairs' landings; empty when this thread reads everything.
  std::vector<std::unique_ptr<RecvThread>> readers_;
  std::vector<RecvThread*> reader_ptrs_;  // handed to every new pair
  // First to stop (destructor, stop_helpers, fail): no link is adopted after that.
  std::unique_ptr<LinkSource> linker_;
};

}  // namespace mccl
