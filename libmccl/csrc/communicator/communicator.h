// A communicator: the mesh of links to the other ranks, a worker thread that runs the
// queued operations in call order, and a completion thread that hands finished
// operations to the caller in batches.
//
// Every operation is enqueued and returns an id at once. Collectives run one at a
// time on the worker, which drives the network itself while it waits (transport.h).
// Point-to-point operations are only posted by the worker and complete during any
// later progress, so a rank that posts recv-then-send never deadlocks against a peer
// doing the same. The idle worker keeps polling the sockets (and a wake-up pipe for
// new ops), so a dead peer is noticed even between operations.
//
// Completions are delivered in batches: the completion thread takes everything that
// finished since its last call and calls `deliver` once (the Python binding takes the
// GIL once per batch; a per-op callback made 50 async ops take 160-410 ms instead of
// ~10 ms on a prototype).
//
// After any error the communicator is failed: the op that saw it, every pending op and
// every later op complete with the same typed error.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "algorithms/algorithms.h"
#include "algorithms/collective.h"
#include "algorithms/cost_model.h"
#include "core/dtype.h"
#include "core/errors.h"
#include "core/options.h"
#include "core/ticket.h"
#include "communicator/op_signature.h"
#include "compress/codec_pool.h"
#include "compress/feedback.h"
#include "transport/handed_links.h"
#include "transport/mesh.h"
#include "transport/transport.h"

namespace mccl {

struct Completion {
  uint64_t op_id = 0;
  std::shared_ptr<const Error> error;  // null: success
  int info = -1;                       // recv: the source rank; else -1
};

struct CommStats {
  uint64_t ops_completed = 0;
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t unexpected_messages = 0;  // arrived before their receive was posted
  uint64_t unexpected_bytes = 0;
  int linked_peers = 0;  // peers this rank holds a link to (links on demand)
  int link_sockets = 0;  // and the sockets of those links
  std::vector<std::pair<uint64_t, uint64_t>> per_peer;  // (sent, received) by rank
};

// One queued operation; which fields matter depends on `kind`.
struct Op {
  uint64_t id = 0;
  OpKind kind = OpKind::kBarrier;
  bool is_send = false;  // p2p direction
  void* buf = nullptr;   // in-place buffer, or the send buffer
  void* out = nullptr;   // receive buffer of out-of-place ops
  size_t count = 0;      // elements (reductions) or bytes (others)
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;         // root, or p2p peer (-1: any source)
  uint32_t tag = 0;
  // Seconds the op may take. < 0: the communicator's timeout, stamped at enqueue;
  // 0 (p2p only): no deadline, so only the message, a peer's failure, abort or shutdown end it.
  double timeout_s = -1;
  OpTickets tickets;  // all-reduce only; `done` is poisoned when the op fails
  // A local step, no message: holds back the ops queued after it until tickets.ready
  // reaches tickets.base + count (gate()).
  bool gate = false;
  std::vector<size_t> send_sizes, send_offsets, recv_sizes, recv_offsets;
  // Compressed all-reduce and reduce-scatter: what keys the buffer's error feedback
  // (compress/feedback.h); 0: the buffer's own address. mccld runs every op on a reused
  // segment, so it passes the client's tensor address, which is what stays put per bucket.
  uintptr_t feedback_key = 0;
};

class Communicator {
 public:
  using Deliver = std::function<void(std::vector<Completion>& batch)>;

  // Links to the collectives' peers (algorithms/partners.h; blocking, bounded by
  // opts.connect_timeout_s; setting *cancel from another thread interrupts it) and starts
  // the threads. Other peers are linked when an op first needs them (transport/linker.h),
  // over a dup of `listen_fd` kept for the communicator's life. `secret`: the job secret every
  // link proves in its handshake and derives its frame keys from (transport/handshake.h);
  // at least 32 bytes, required unless opts.wire_security is kOff (then it must be empty).
  Communicator(int rank, int size, uint64_t comm_id, int listen_fd,
               std::vector<std::string> peer_addrs, const Options& opts,
               const std::string& secret, Deliver deliver, std::atomic<bool>* cancel = nullptr);
  // Builds it on sockets the caller already connected: `fds[peer]` holds
  // opts.sockets_per_peer sockets to each peer it leased (empty for this rank and the
  // others: an op that needs one of those fails with a ConfigError naming it), which the engine
  // dup()s and handshakes on (transport/mesh.h adopt_mesh). These borrowed sockets are
  // left reusable by a clean shutdown (see released_clean).
  // The same handshake runs on them, so every job derives fresh frame keys.
  // With `ask`, the other peers are linked on demand over sockets the caller hands in
  // (transport/handed_links.h): a send to an unlinked peer calls ask(peer) on a thread of
  // the engine's (it must return at once), and the caller answers with hand_in or
  // refuse_link; a peer's own hand_in may come unasked (it sends to us).
  Communicator(int rank, int size, uint64_t comm_id, std::vector<std::vector<int>> fds,
               std::vector<std::string> peer_addrs, const Options& opts,
               const std::string& secret, Deliver deliver, HandedLinks::Ask ask = nullptr);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // With tickets the op reads the buffer piece by piece as `ready` covers it and raises
  // `done` as pieces finish (ticket.h, algorithms/pieces.h).
  uint64_t allreduce(void* buf, size_t count, DType dt, ReduceOp op, OpTickets tickets = {},
                     uintptr_t feedback_key = 0);
  uint64_t broadcast(void* buf, size_t nbytes, int root);
  uint64_t allgather(const void* send, void* recv, size_t nbytes);
  uint64_t reduce_scatter(const void* send, void* recv, size_t count, DType dt, ReduceOp op,
                          uintptr_t feedback_key = 0);
  uint64_t reduce(void* buf, size_t count, DType dt, ReduceOp op, int root);
  uint64_t gather(const void* send, void* recv, size_t nbytes, int root);
  uint64_t scatter(const void* send, void* recv, size_t nbytes, int root);
  uint64_t alltoall(const void* send, void* recv, size_t nbytes);
  uint64_t alltoallv(const void* send, std::vector<size_t> send_sizes,
                     std::vector<size_t> send_offsets, void* recv, std::vector<size_t> recv_sizes,
                     std::vector<size_t> recv_offsets);
  uint64_t barrier();
  // The ops enqueued after this one start once `ready` >= base + nbytes: a device's
  // staging copy has landed (libmccl/device_staging.py). A poisoned ticket or the
  // timeout fails the communicator, so the next op reports it. Reports no completion.
  void gate(std::shared_ptr<Ticket> ready, uint64_t base, size_t nbytes);
  // timeout_s: unset, the communicator's timeout; 0, no deadline (a receive that may wait
  // for a message as long as the communicator lives, e.g. mccld's mailbox: a dead peer,
  // abort or shutdown still end it); > 0, its own.
  uint64_t send(const void* buf, size_t nbytes, int dst, int64_t tag,
                std::optional<double> timeout_s = std::nullopt);
  uint64_t recv(void* buf, size_t nbytes, int src, int64_t tag,
                std::optional<double> timeout_s = std::nullopt);

  // A waiter that bounds an op by the op's own timeout waits this much longer: the op's
  // deadline starts when the worker takes it up, after the wait began, so without it the
  // wait's bare "Timed out waiting for op #N" wins the race against the op's own error,
  // which names the peer it waited for (mccld's job thread and dispatcher). 0.5 s was
  // too little once on the 2-core VM under load (a campaign trial got the bare wait).
  static constexpr double kOwnDeadlineGraceS = 1.0;
  // How long an op with `timeout_s` may take to end with its own error: the timeout, the
  // transport's wait for firmer evidence (Transport::weak_evidence_margin_s; CI once saw
  // the bare wait win when a cut link left only weak evidence), and the grace above.
  static double own_error_bound_s(double timeout_s) {
    return timeout_s + Transport::weak_evidence_margin_s(timeout_s) + kOwnDeadlineGraceS;
  }
  // Bytes of the largest piece a ticketed all-reduce of `count` elements among `size` ranks
  // is cut into (pieces.h), 0 when it is not pieced: a producer that feeds `ready` only so
  // far ahead of `done` must stay at least one piece ahead, or the ring waits for it forever.
  static size_t allreduce_piece_bytes(const Options& opts, int size, size_t count, DType dt);
  // Blocks until op `id` finished; throws its error, or CollectiveTimeout after timeout_s.
  void wait(uint64_t id, double timeout_s);
  // Like wait, but returns false (instead of throwing) if the op is still pending.
  bool wait_for(uint64_t id, double timeout_s);
  [[noreturn]] void throw_wait_timeout(uint64_t id, double timeout_s) const;
  // Fails every pending op with AbortedError, tells live peers, closes the links.
  void abort(const std::string& reason);
  // Lets queued ops finish (up to timeout_s), then stops threads and closes links. With
  // borrowed sockets it then exchanges BYE with every peer, waiting up to timeout_s more.
  void shutdown(double timeout_s);
  // Borrowed sockets only: true once shutdown left every socket at a clean stream boundary
  // (our BYE sent, the peer's BYE read, nothing else in flight), so the owner may hand
  // them to the next communicator. False after an abort, a failure or a late peer.
  bool released_clean() const { return released_clean_.load(); }

  // Links on demand over handed-in sockets (the constructor's `ask`): K sockets to `peer`,
  // which the engine dup()s and proves on a thread of its own; throws a ConfigError on a
  // communicator without `ask`, or for a peer linked already.
  void hand_in(int peer, const std::vector<int>& fds);
  // The caller cannot link `peer`: the communicator fails with this error (naming it).
  void refuse_link(int peer, ErrorKind kind, const std::string& message);

  // Per-operation timeout of ops enqueued from now on (torch's set_timeout); > 0 s.
  void set_timeout(double timeout_s);

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t comm_id() const { return comm_id_; }
  const std::string& peer_address(int r) const;
  // [peer][socket] -> (send key id, recv key id), hex; empty under WireSecurity::kOff.
  const std::vector<std::vector<std::pair<std::string, std::string>>>& link_key_ids() const {
    return key_ids_;
  }
  CommStats stats() const;

  // The cost model's parameters every rank agreed on at start (measured, or pinned by
  // MCCL_ALPHA_US / MCCL_BETA_GBPS): blocks until the worker has them, up to timeout_s.
  CostParams cost_params(double timeout_s);
  // The algorithm the last op of `op` ran (kAuto before the first).
  Algo last_algorithm(AlgoOp op) const { return last_algo_[static_cast<int>(op)].load(); }

 private:
  void validate_world() const;
  MeshSpec mesh_spec(const std::string& secret) const;
  // What our collectives' signatures and terms mean, for the transport (one for all).
  static std::shared_ptr<const CollectiveRules> rules() {
    static const auto r = std::make_shared<const CollectiveRules>();
    return r;
  }
  void start(MeshLinks mesh, std::unique_ptr<LinkSource> links = nullptr);
  uint64_t enqueue(Op op);
  void check_root(int root, const char* op) const;
  void check_ptr(const void* p, size_t n, const char* what, const char* op) const;
  void check_reduction(DType dt, ReduceOp op, const char* name) const;

  void worker_main();
  // Once, first thing on the worker: measure and agree on the cost model's parameters.
  void calibrate();
  Algo choose_algo(AlgoOp op, size_t bytes) const { return select_algo(op, pins_, size_, bytes, cost_, opts_); }
  void run(Op& op);
  void run_gate(Op& op);
  void run_collective(Op& op);
  bool hierarchical(const Op& op) const;
  // The codec `op` runs compressed with (MCCL_COMPRESSION), kOff if it runs exact.
  Codec compression(const Op& op) const;
  void run_compressed(Collective& c, Op& op, Codec codec);  // run this all-reduce switch by switch
  void post_p2p(const Op& op);
  void idle_progress();
  void on_error(const Error& e);
  std::shared_ptr<const Error> failure() const;
  void complete(uint64_t id, std::shared_ptr<const Error> err, int info);
  void completion_main();
  void stop_threads(bool from_completion_thread);

  const int rank_;
  const int size_;
  const uint64_t comm_id_;
  const Options opts_;
  std::vector<std::string> addrs_;
  // Per socket, short public ids of the (send, recv) frame keys the handshakes derived:
  // lets tests and operators see that keys differ per socket and per job without them.
  std::vector<std::vector<std::pair<std::string, std::string>>> key_ids_;
  const bool borrowed_;         // links built on the caller's sockets (adopt_mesh)
  double release_timeout_s_ = 2.0;  // set by shutdown() before the worker reads it
  std::atomic<bool> released_clean_{false};
  std::unique_ptr<Transport> transport_;
  HandedLinks* handed_ = nullptr;  // the transport's link source, if built with `ask`
  Scratch scratch_;
  Hierarchy hierarchy_;  // from opts_.switch_of_rank; inactive for one switch
  Residuals residuals_;  // error feedback of compressed ops, per buffer (worker thread only)
  // MCCL_COMPRESSION_THREADS > 1: the codec's helper threads, started by the worker at its
  // first compressed op, used by it alone, stopped once it has exited (stop_threads).
  std::unique_ptr<CodecPool> codec_pool_;
  bool feedback_cap_warned_ = false;  // worker thread only
  uint64_t coll_seq_ = 0;  // worker only

  // The algorithm choice (cost_model.h): pins from MCCL_ALGO; parameters written once by
  // calibrate() on the worker before any op, read by cost_params() under mu_.
  const AlgoPins pins_;
  CostParams cost_;
  bool calibrated_ = false;  // mu_; done_cv_ tells waiters
  std::atomic<Algo> last_algo_[kNumAlgoOps] = {Algo::kAuto, Algo::kAuto, Algo::kAuto, Algo::kAuto};

  // Op queue and op state (mu_).
  mutable std::mutex mu_;
  std::condition_variable queue_cv_;  // worker: new op or stop
  std::condition_variable done_cv_;   // wait()/shutdown(): an op finished
  std::deque<Op> queue_;
  uint64_t next_id_ = 1;
  std::unordered_set<uint64_t> pending_;  // enqueued, not completed
  std::unordered_map<uint64_t, std::shared_ptr<const Error>> failed_ops_;
  std::shared_ptr<const Error> sticky_;   // the communicator's failure
  bool closing_ = false;                  // no new ops accepted
  bool stop_ = false;                     // worker: exit when idle
  bool worker_idle_ = true;               // worker found the queue empty and may sleep
  uint64_t ops_completed_ = 0;

  std::atomic<double> timeout_s_;  // stamped on each op at enqueue

  // Pending p2p ops (worker only): id -> (deadline, its timeout); Deadline::max() for none.
  std::unordered_map<uint64_t, std::pair<Deadline, double>> p2p_deadlines_;

  // Completions (cmu_).
  std::mutex cmu_;
  std::condition_variable ccv_;
  std::vector<Completion> completions_;
  bool cstop_ = false;
  Deliver deliver_;

  std::mutex stop_mu_;  // serialises shutdown/abort callers
  bool stopped_ = false;
  std::thread worker_;
  std::thread completer_;
};

}  // namespace mccl
