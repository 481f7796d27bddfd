#include "communicator/communicator.h"

#include <algorithm>
#include <cstdio>

#include <fcntl.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "algorithms/algorithms.h"
#include "algorithms/calibrate.h"
#include "algorithms/partners.h"
#include "core/fd_limit.h"
#include "core/log.h"
#include "core/thread_name.h"
#include "reduce/reduce.h"

namespace mccl {

namespace {

// Scratch slots up to this size stay allocated between ops (a DDP bucket is 25 MB);
// bigger ones are freed after their op.
constexpr size_t kKeepScratchBytes = 64 << 20;

// Files a communicator opens besides its link sockets: the listener's dup, wake pipes of
// the progress and send threads (and 2 per receive thread, added by the callers).
constexpr int kHelperFiles = 6;
// Headroom asked for beyond what the communicator itself needs (the caller's own files).
constexpr int kSpareFiles = 64;

// Job secrets come from mccl_common.jobkey.derive (32 bytes); shorter ones are guessable.
constexpr size_t kMinSecretBytes = 32;

// A public name for a key: HMAC(key, label), 8 bytes in hex. One-way, so showing it
// reveals nothing of the key, yet equal keys give equal ids.
std::string key_id(const uint8_t key[kMacKeyBytes]) {
  static const char kLabel[] = "mccl frame key id";
  uint8_t mac[kLinkProofBytes];
  hmac_sha256(LinkSecret(std::string(reinterpret_cast<const char*>(key), kMacKeyBytes)),
              {{kLabel, sizeof(kLabel)}}, mac);
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (int i = 0; i < 8; ++i) {
    out += hex[mac[i] >> 4];
    out += hex[mac[i] & 15];
  }
  return out;
}


}  // namespace

Communicator::Communicator(int rank, int size, uint64_t comm_id, int listen_fd,
                           std::vector<std::string> peer_addrs, const Options& opts,
                           const std::string& secret, Deliver deliver,
                           std::atomic<bool>* cancel)
    : rank_(rank),
      size_(size),
      comm_id_(comm_id),
      opts_(opts),
      addrs_(std::move(peer_addrs)),
      borrowed_(false),
      pins_(AlgoPins::parse(opts.algo)),
      timeout_s_(opts.timeout_s),
      deliver_(std::move(deliver)) {
  validate_world();
  hierarchy_ = Hierarchy::of(opts_.switch_of_rank, rank_);
  MeshSpec spec = mesh_spec(secret);
  const std::vector<int> eager = collective_peers(rank_, size_);
  {
    // Needed: the set-up links; hoped for: a link to every peer (all-to-all, p2p).
    int need = 0, all = 0;
    for (int peer : eager) need += Linker::sockets_for(rank_, peer, size_, opts_.sockets_per_peer);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) all += Linker::sockets_for(rank_, peer, size_, opts_.sockets_per_peer);
    }
    const int helpers = kHelperFiles + 2 * opts_.recv_threads;
    const std::string who = "[engine] rank " + std::to_string(rank_);
    ensure_open_files(need + helpers, std::max(open_file_count(), 0) + all + helpers + kSpareFiles,
                      who.c_str());
  }
  // Our own copy: the links are opened on demand for as long as the communicator lives,
  // while the caller closes its listener once we are built.
  const int fd = ::fcntl(listen_fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) {
    throw_error(ErrorKind::kConfig, std::string("[engine] the listening socket is not an open "
                                                "fd (") +
                                        std::strerror(errno) + "); pass the Listener's fd");
  }
  auto linker = std::make_unique<Linker>(std::move(spec), Fd(fd), opts_.connect_timeout_s);
  // Set-up links only the collectives' peers (O(log N), algorithms/partners.h), the lower
  // rank of each pair dialing; every other link is opened by the first op that needs it.
  for (int peer : eager) {
    if (peer > rank_) linker->want(peer);
  }
  MeshLinks mesh = linker->wait_for(eager, deadline_after(opts_.connect_timeout_s), cancel);
  start(std::move(mesh), std::move(linker));
}

Communicator::Communicator(int rank, int size, uint64_t comm_id,
                           std::vector<std::vector<int>> fds, std::vector<std::string> peer_addrs,
                           const Options& opts, const std::string& secret, Deliver deliver,
                           HandedLinks::Ask ask)
    : rank_(rank),
      size_(size),
      comm_id_(comm_id),
      opts_(opts),
      addrs_(std::move(peer_addrs)),
      borrowed_(true),
      pins_(AlgoPins::parse(opts.algo)),
      timeout_s_(opts.timeout_s),
      deliver_(std::move(deliver)) {
  validate_world();
  hierarchy_ = Hierarchy::of(opts_.switch_of_rank, rank_);
  {
    int need = kHelperFiles + 2 * opts_.recv_threads;
    for (const auto& per_peer : fds) need += static_cast<int>(per_peer.size());  // the dups
    const std::string who = "[engine] rank " + std::to_string(rank_);
    ensure_open_files(need, std::max(open_file_count(), 0) + need + kSpareFiles, who.c_str());
  }
  MeshLinks mesh = adopt_mesh(mesh_spec(secret), fds, deadline_after(opts_.connect_timeout_s));
  if (!ask) {
    start(std::move(mesh));
    return;
  }
  auto handed = std::make_unique<HandedLinks>(mesh_spec(secret), std::move(ask),
                                              opts_.connect_timeout_s);
  for (int peer = 0; peer < size_; ++peer) {
    if (!mesh.links[peer].empty()) handed->linked(peer);
  }
  handed_ = handed.get();
  start(std::move(mesh), std::move(handed));
}

void Communicator::hand_in(int peer, const std::vector<int>& fds) {
  if (!handed_) {
    throw_error(ErrorKind::kConfig,
                "[engine] hand_in on a communicator built without `ask`: its links are fixed "
                "at construction; build it with an ask callback to link peers on demand");
  }
  handed_->hand_in(peer, fds);
}

void Communicator::refuse_link(int peer, ErrorKind kind, const std::string& message) {
  if (handed_) handed_->refuse(peer, kind, message);
}

size_t Communicator::allreduce_piece_bytes(const Options& opts, int size, size_t count, DType dt) {
  const Pieces p = allreduce_pieces(opts, size, count, dt);
  return p.n == 0 ? 0 : p.piece_elems * p.elem;
}

void Communicator::validate_world() const {
  opts_.validate();
  if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
    throw_error(ErrorKind::kConfig, "[engine] rank " + std::to_string(rank_) +
                                        " is outside a world of size " + std::to_string(size_));
  }
  if (static_cast<int>(addrs_.size()) != size_) {
    throw_error(ErrorKind::kConfig, "[engine] got " + std::to_string(addrs_.size()) +
                                        " peer addresses for a world of size " +
                                        std::to_string(size_) + "; pass one per rank");
  }
  if (!opts_.switch_of_rank.empty() && static_cast<int>(opts_.switch_of_rank.size()) != size_) {
    throw_error(ErrorKind::kConfig, "[engine] got a switch for " +
                                        std::to_string(opts_.switch_of_rank.size()) +
                                        " ranks in a world of size " + std::to_string(size_) +
                                        "; MCCL_TOPOLOGY must place every rank (or none)");
  }
}

// Small and separate, so an algorithm chooser can take it over: the same answer on every
// rank (the groups and the threshold are the same everywhere, and so are the op's sizes).
bool Communicator::hierarchical(const Op& op) const {
  return op.kind == OpKind::kAllreduce && hierarchy_.active() &&
         op.count * dtype_size(op.dtype) >= opts_.hierarchy_min_bytes &&
         op.count >= static_cast<size_t>(size_);
}

Codec Communicator::compression(const Op& op) const {
  const Codec k = static_cast<Codec>(opts_.compression);
  const bool reduces = op.kind == OpKind::kAllreduce || op.kind == OpKind::kReduceScatter;
  const bool sums = op.op == ReduceOp::kSum || op.op == ReduceOp::kAvg;
  if (k == Codec::kOff || !reduces || !sums || size_ == 1 || !codec_applies(k, op.dtype)) return Codec::kOff;
  // A reduce-scatter's size: the whole input, as an all-reduce of the same gradients.
  const size_t bytes = op.count * dtype_size(op.dtype) * (op.kind == OpKind::kReduceScatter ? size_ : 1);
  return bytes >= opts_.compression_min_bytes ? k : Codec::kOff;
}

MeshSpec Communicator::mesh_spec(const std::string& secret) const {
  const bool keyed = opts_.wire_security != WireSecurity::kOff;
  if (keyed && secret.size() < kMinSecretBytes) {
    throw_error(ErrorKind::kConfig,
                std::string("[engine] ") +
                    (secret.empty() ? "no job secret given" : "the job secret is too short") +
                    ": MCCL_WIRE_SECURITY=" + (opts_.wire_security == WireSecurity::kMac ? "mac" : "aead") +
                    " needs at least " + std::to_string(kMinSecretBytes) +
                    " bytes shared by every rank to open the links; give the job key "
                    "(MCCL_JOB_KEY_FILE / the fleet key), or MCCL_WIRE_SECURITY=off on a trusted network");
  }
  if (!keyed && !secret.empty()) {
    throw_error(ErrorKind::kConfig,
                "[engine] a job secret was given but MCCL_WIRE_SECURITY=off would not use it; "
                "set MCCL_WIRE_SECURITY to aead or mac, or pass no secret");
  }
  MeshSpec spec;
  spec.wire_security = static_cast<uint32_t>(opts_.wire_security);
  spec.secret = LinkSecret(secret);
  spec.rank = rank_;
  spec.size = size_;
  spec.comm_id = comm_id_;
  spec.sockets_per_peer = opts_.sockets_per_peer;
  spec.socket_buffer_bytes = opts_.socket_buffer_bytes;
  spec.terms = terms_of(opts_);
  spec.rules = rules();
  spec.peer_addrs = addrs_;
  return spec;
}

void Communicator::start(MeshLinks mesh, std::unique_ptr<LinkSource> links) {
  key_ids_.assign(mesh.keys.size(), {});
  for (size_t r = 0; r < mesh.keys.size(); ++r) {
    for (const FrameKeys& k : mesh.keys[r]) key_ids_[r].emplace_back(key_id(k.send), key_id(k.recv));
  }
  transport_ = std::make_unique<Transport>(rank_, size_, comm_id_, std::move(mesh.links), addrs_,
                                           opts_.send_thread, opts_.recv_threads, mesh.keys,
                                           rules(),
                                           // The handshake gives keys exactly when the mode wants them.
                                           mesh.keys.empty() ? WireSecurity::kOff : opts_.wire_security);
  for (auto& per_peer : mesh.keys) wipe(per_peer.data(), per_peer.size() * sizeof(FrameKeys));
  if (links) transport_->use_linker(std::move(links));
  worker_ = std::thread([this] {
    name_this_thread("mccl-worker");
    worker_main();
  });
  completer_ = std::thread([this] {
    name_this_thread("mccl-complete");
    completion_main();
  });
}

Communicator::~Communicator() {
  shutdown(2.0);
  if (completer_.joinable()) {
    // Dropped from inside a completion callback: that thread cannot join itself.
    if (completer_.get_id() == std::this_thread::get_id()) {
      completer_.detach();
    } else {
      completer_.join();
    }
  }
}

const std::string& Communicator::peer_address(int r) const {
  if (r < 0 || r >= size_) {
    throw_error(ErrorKind::kConfig, "[engine] no rank " + std::to_string(r) + " in a world of size " +
                                        std::to_string(size_));
  }
  return addrs_[r];
}

// ---------------------------------------------------------------- enqueueing

uint64_t Communicator::enqueue(Op op) {
  uint64_t id;
  bool wake;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closing_) {
      if (op.tickets.done) op.tickets.done->poison();
      throw_error(ErrorKind::kAborted,
                  std::string("[engine] ") + (op.gate ? "device gate" : op_kind_name(op.kind)) +
                      " called on a communicator that is shut down or aborted; create a new "
                      "process group");
    }
    id = next_id_++;
    op.id = id;
    if (op.timeout_s < 0) op.timeout_s = timeout_s_.load(std::memory_order_relaxed);
    pending_.insert(id);
    queue_.push_back(std::move(op));
    wake = worker_idle_;
  }
  // A busy worker looks at the queue when its op ends; only an idle one (asleep in
  // poll or on the condvar) needs waking, which spares a syscall per op in a burst.
  if (wake) {
    queue_cv_.notify_one();
    transport_->wake();
  }
  return id;
}

// ---------------------------------------------------------------- the worker

void Communicator::worker_main() {
  calibrate();
  while (true) {
    Op op;
    bool have = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
      worker_idle_ = queue_.empty();  // set under mu_: enqueue() then knows to wake us
      if (!queue_.empty()) {
        op = std::move(queue_.front());
        queue_.pop_front();
        have = true;
      } else if (stop_ && (sticky_ || p2p_deadlines_.empty())) {
        break;
      } else if (sticky_) {
        // Failed and idle: nothing to drive; later ops fail as soon as they arrive.
        queue_cv_.wait_for(lk, std::chrono::seconds(1));
        continue;
      }
    }
    if (have) {
      run(op);
    } else {
      idle_progress();
    }
  }
  if (!transport_->failure()) {
    if (transport_->abort_requested()) {
      idle_progress();  // turns the requested abort into ABORT frames to every peer
    } else if (borrowed_) {
      released_clean_.store(transport_->release(deadline_after(release_timeout_s_)));
    } else {
      transport_->close_gracefully(deadline_after(1.0));
    }
  }
}

// ---------------------------------------------------------------- the cost model

// Two collectives of their own (signed kCalibrate), before any op: every rank's worker runs
// them first, so they pair up like any op. A failure fails the communicator (its first op
// reports it), as a broken link would.
void Communicator::calibrate() {
  CostParams p;
  if (size_ > 1) {
    try {
      const double timeout = timeout_s_.load();
      Collective c{*transport_, deadline_after(timeout), timeout, opts_, scratch_};
      OpSignature sig;
      sig.kind = OpKind::kCalibrate;
      sig.op_bytes = 1;  // the measurement
      transport_->begin_collective(coll_seq_++, encode_signature(sig));
      p = measure_cost(c);
      transport_->end_collective();
      sig.op_bytes = 2;  // the agreement
      transport_->begin_collective(coll_seq_++, encode_signature(sig));
      agree_median(c, p);
      transport_->end_collective();
    } catch (const Error& e) {
      on_error(e);
    }
  }
  // Pins replace what was measured; equal on every rank, or the signatures tell.
  if (opts_.alpha_us > 0) p.alpha_s = opts_.alpha_us * 1e-6;
  if (opts_.beta_gbps > 0) p.beta_s_per_byte = 8.0 / (opts_.beta_gbps * 1e9);
  {
    std::lock_guard<std::mutex> lk(mu_);
    cost_ = p;
    calibrated_ = true;
  }
  done_cv_.notify_all();
}

CostParams Communicator::cost_params(double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!done_cv_.wait_until(lk, deadline_after(timeout_s), [&] { return calibrated_; })) {
    throw_error(ErrorKind::kTimeout, "[engine] Timed out after " + format_seconds(timeout_s) +
                                         " s waiting for the cost model's parameters; the other "
                                         "ranks have not started their communicators");
  }
  return cost_;
}

void Communicator::run(Op& op) {
  if (op.gate) {
    run_gate(op);
    return;
  }
  if (auto sticky = failure()) {
    if (op.tickets.done) op.tickets.done->poison();
    complete(op.id, sticky, -1);
    return;
  }
  try {
    if (op.kind == OpKind::kP2P) {
      post_p2p(op);  // completes later, from the transport's callback
    } else {
      run_collective(op);
      complete(op.id, nullptr, -1);
    }
    return;
  } catch (const Error& e) {
    on_error(e);
  } catch (const std::exception& e) {
    on_error(Error(ErrorKind::kGeneric, std::string("[engine] internal error in ") +
                                            op_kind_name(op.kind) + ": " + e.what()));
  }
  // Before completing: whoever waits on `done` must not see a half-written result as final.
  if (op.tickets.done) op.tickets.done->poison();
  complete(op.id, failure(), -1);  // a no-op if the failure already completed it
}

// Silent either way: a failed wait fails the communicator, so the op queued behind the
// gate (the one it guards) completes with that error.
void Communicator::run_gate(Op& op) {
  try {
    if (!failure()) {
      Collective c{*transport_, deadline_after(op.timeout_s), op.timeout_s, opts_, scratch_};
      const Pieces whole = Pieces::cut(1, op.count, op.count, 1);  // target: base + count
      PieceGate(c, op.tickets, whole, "device gate").wait_ready(0);
    }
  } catch (const Error& e) {
    on_error(e);
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending_.erase(op.id);
  }
  done_cv_.notify_all();
}

std::shared_ptr<const Error> Communicator::failure() const {
  std::lock_guard<std::mutex> lk(mu_);
  return sticky_;
}

void Communicator::run_collective(Op& op) {
  OpSignature sig;
  sig.kind = op.kind;
  const size_t es = dtype_size(op.dtype);
  switch (op.kind) {
    case OpKind::kAllreduce:
    case OpKind::kReduceScatter:
    case OpKind::kReduce:
      sig.op_bytes = op.count * es;
      sig.dtype = static_cast<uint8_t>(op.dtype);
      sig.redop = static_cast<uint8_t>(op.op);
      if (op.tickets.any()) {
        sig.pieces = static_cast<uint32_t>(allreduce_pieces(opts_, size_, op.count, op.dtype).n);
      }
      break;
    case OpKind::kAlltoallv:
    case OpKind::kBarrier:
      break;  // sizes legitimately differ per rank; each message is checked instead
    default:
      sig.op_bytes = op.count;
  }
  if (op.kind == OpKind::kBroadcast || op.kind == OpKind::kReduce ||
      op.kind == OpKind::kGather || op.kind == OpKind::kScatter) {
    sig.root = op.root;
  }
  // The algorithm, by the model (or MCCL_ALGO): a ticketed all-reduce that is pipelined
  // runs the ring (allreduce_pieces says when).
  Algo algo = Algo::kAuto;
  AlgoOp aop = AlgoOp::kAllreduce;
  switch (op.kind) {
    case OpKind::kAllreduce:
      algo = sig.pieces ? Algo::kRing : choose_algo(aop, op.count * es);
      break;
    case OpKind::kAllgather: algo = choose_algo(aop = AlgoOp::kAllgather, op.count); break;
    case OpKind::kReduceScatter: algo = choose_algo(aop = AlgoOp::kReduceScatter, op.count * es); break;
    case OpKind::kBroadcast: algo = choose_algo(aop = AlgoOp::kBroadcast, op.count); break;
    default: break;
  }
  // Compression was asked for and changes the results, so it is not the model's to decline;
  // it runs instead of the switch hierarchy and the tickets' pipeline (compressed.cc).
  const Codec codec = compression(op);
  if (codec != Codec::kOff) {
    algo = compressed_algo(codec);
    sig.pieces = 0;
  }
  if (algo != Algo::kAuto) last_algo_[static_cast<int>(aop)].store(algo);
  sig.algo = static_cast<uint8_t>(algo);
  const bool by_switch = codec == Codec::kOff && hierarchical(op);
  // Ranks grouped differently, or by the other algorithm, fail at once (a topology mismatch).
  if (by_switch) sig.root = (hierarchy_.fingerprint & 0x3fffffff) | (opts_.hierarchy_ring ? 1 << 30 : 0);
  transport_->begin_collective(coll_seq_++, encode_signature(sig));
  Collective c{*transport_, deadline_after(op.timeout_s), op.timeout_s, opts_, scratch_};
  if (codec != Codec::kOff) {
    run_compressed(c, op, codec);
    transport_->end_collective();
    scratch_.trim(kKeepScratchBytes);
    return;
  }
  switch (op.kind) {
    case OpKind::kAllreduce:
      if (by_switch && opts_.hierarchy_ring) {
        allreduce_switch_ring(c, op.buf, op.count, Reduction::of(op.dtype, op.op), hierarchy_, op.tickets);
      } else if (by_switch) {
        allreduce_hierarchical(c, op.buf, op.count, Reduction::of(op.dtype, op.op), hierarchy_, op.tickets);
      } else if (op.tickets.any()) {
        mccl::allreduce(c, algo, op.buf, op.count, Reduction::of(op.dtype, op.op), op.tickets);
      } else {
        mccl::allreduce(c, algo, op.buf, op.count, Reduction::of(op.dtype, op.op));
      }
      break;
    case OpKind::kBroadcast: mccl::broadcast(c, algo, op.buf, op.count, op.root); break;
    case OpKind::kAllgather: mccl::allgather(c, algo, op.buf, op.out, op.count); break;
    case OpKind::kReduceScatter:
      mccl::reduce_scatter(c, algo, op.buf, op.out, op.count, Reduction::of(op.dtype, op.op));
      break;
    case OpKind::kReduce:
      mccl::reduce_to_root(c, op.buf, op.count, Reduction::of(op.dtype, op.op), op.root);
      break;
    case OpKind::kGather: mccl::gather(c, op.buf, op.out, op.count, op.root); break;
    case OpKind::kScatter: mccl::scatter(c, op.buf, op.out, op.count, op.root); break;
    case OpKind::kAlltoall: mccl::alltoall(c, op.buf, op.out, op.count); break;
    case OpKind::kAlltoallv:
      mccl::alltoallv(c, op.buf, op.send_sizes, op.send_offsets, op.out, op.recv_sizes, op.recv_offsets);
      break;
    case OpKind::kBarrier: mccl::barrier(c); break;
    default:
      throw_error(ErrorKind::kGeneric, "[engine] not a collective: " +
                                           std::string(op_kind_name(op.kind)));
  }
  transport_->end_collective();
  scratch_.trim(kKeepScratchBytes);
}

void Communicator::run_compressed(Collective& c, Op& op, Codec codec) {
  const Reduction red = Reduction::of(op.dtype, op.op);
  const size_t elems = op.count * (op.kind == OpKind::kReduceScatter ? size_t(size_) : 1);
  const void* key = op.feedback_key ? reinterpret_cast<const void*>(op.feedback_key) : op.buf;
  residuals_.set_max_bytes(opts_.compression_feedback_max_bytes);
  const uint64_t capped = residuals_.capped();
  float* residual = opts_.compression_feedback ? residuals_.get(key, op.count, op.dtype, op.op, elems) : nullptr;
  if (residuals_.capped() != capped && !feedback_cap_warned_) {
    feedback_cap_warned_ = true;
    log_line(LogLevel::kWarning,
             "[engine] compression error feedback: the residuals of this communicator's buffers exceed "
             "MCCL_COMPRESSION_FEEDBACK_MAX_BYTES=" + std::to_string(opts_.compression_feedback_max_bytes) +
             "; the least recently used buffers lose theirs (their next op starts from zero); raise it to "
             "about 4 bytes per compressed gradient element (logged once)");
  }
  if (opts_.compression_threads > 1 && !codec_pool_) {
    try {
      codec_pool_ = std::make_unique<CodecPool>(opts_.compression_threads);
    } catch (const std::system_error& e) {
      throw_error(ErrorKind::kConfig, "[engine] could not start " + std::to_string(opts_.compression_threads - 1) +
                                          " codec threads (MCCL_COMPRESSION_THREADS=" +
                                          std::to_string(opts_.compression_threads) + "): " + e.what() +
                                          "; likely cause: the process's thread limit; lower the setting");
    }
  }
  CodecPool* pool = codec_pool_.get();
  if (op.kind == OpKind::kReduceScatter) {
    reduce_scatter_compressed(c, codec, op.buf, op.out, op.count, red, residual, pool);
    return;
  }
  // A ticketed op starts each group of chunks as its input range becomes ready and announces
  // groups done as they become final (compressed.cc); the op's deadline bounds every wait.
  allreduce_compressed(c, codec, op.buf, op.count, red, residual, pool, op.tickets);
}

void Communicator::post_p2p(const Op& op) {
  const uint64_t id = op.id;
  const Deadline deadline = op.timeout_s > 0 ? deadline_after(op.timeout_s) : Deadline::max();
  p2p_deadlines_[id] = {deadline, op.timeout_s};
  auto done = [this, id](Request& r) {
    p2p_deadlines_.erase(id);
    complete(id, r.error, r.is_send ? -1 : r.peer);
  };
  if (op.is_send) {
    transport_->send_p2p(op.root, op.buf, op.count, op.tag, done);
  } else {
    transport_->recv_p2p(op.root, op.buf, op.count, op.tag, done);
  }
}

void Communicator::idle_progress() {
  Deadline until = Clock::now() + std::chrono::seconds(1);
  for (auto& kv : p2p_deadlines_) until = std::min(until, kv.second.first);
  try {
    transport_->progress(until);
    auto now = Clock::now();
    double expired_after = -1;
    for (auto& kv : p2p_deadlines_) {
      if (kv.second.first <= now) expired_after = std::max(expired_after, kv.second.second);
    }
    // Outside the loop: failing the transport completes (and erases) the p2p ops.
    if (expired_after >= 0) transport_->p2p_timeout(expired_after);
  } catch (const Error& e) {
    on_error(e);
  }
}

void Communicator::on_error(const Error& e) {
  transport_->fail(e);  // idempotent: the first failure wins and is what peers hear
  std::shared_ptr<const Error> err = transport_->failure();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!sticky_) sticky_ = err;
  }
  scratch_.release();
}

void Communicator::complete(uint64_t id, std::shared_ptr<const Error> err, int info) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!pending_.erase(id)) return;
    if (err) failed_ops_[id] = err;
    ++ops_completed_;
    // Queued for the callback before a waiter can see the op done (lock order mu_ -> cmu_,
    // never the reverse): whoever returns from wait() knows its completion is on its way.
    if (deliver_) {
      std::lock_guard<std::mutex> clk(cmu_);
      completions_.push_back({id, err, info});
    }
  }
  done_cv_.notify_all();
  if (deliver_) ccv_.notify_one();  // without a callback, spare the completion thread a wake-up
}

// ---------------------------------------------------------------- completions

void Communicator::completion_main() {
  while (true) {
    std::vector<Completion> batch;
    {
      std::unique_lock<std::mutex> lk(cmu_);
      ccv_.wait_for(lk, std::chrono::seconds(1), [&] { return !completions_.empty() || cstop_; });
      if (completions_.empty()) {
        if (cstop_) break;
        continue;
      }
      batch.swap(completions_);
    }
    if (!deliver_) continue;
    try {
      deliver_(batch);
    } catch (const std::exception&) {
      // The callback's own failure must not kill the engine; the binding logs it.
    }
  }
}

// ---------------------------------------------------------------- waiting and stopping

bool Communicator::wait_for(uint64_t id, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (id == 0 || id >= next_id_) {
    throw_error(ErrorKind::kConfig, "[engine] wait: no operation #" + std::to_string(id));
  }
  if (!done_cv_.wait_until(lk, deadline_after(timeout_s), [&] { return !pending_.count(id); })) {
    return false;
  }
  auto it = failed_ops_.find(id);
  if (it != failed_ops_.end()) throw Error(*it->second);
  return true;
}

void Communicator::wait(uint64_t id, double timeout_s) {
  if (!wait_for(id, timeout_s)) throw_wait_timeout(id, timeout_s);
}

void Communicator::throw_wait_timeout(uint64_t id, double timeout_s) const {
  throw_error(ErrorKind::kTimeout, "[engine] Timed out after " + format_seconds(timeout_s) +
                                       " s waiting for op #" + std::to_string(id) +
                                       "; it is still running; wait longer or check the "
                                       "other ranks reached the same op");
}

void Communicator::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    closing_ = true;
  }
  transport_->request_abort(Error(
      ErrorKind::kAborted,
      "[engine] communicator aborted by rank " + std::to_string(rank_) +
          (reason.empty() ? std::string() : ": " + reason) +
          "; every pending operation was cancelled; create a new process group to continue",
      rank_, addrs_[rank_]));
  stop_threads(completer_.get_id() == std::this_thread::get_id());
}

void Communicator::set_timeout(double timeout_s) {
  if (!(timeout_s > 0)) {
    throw_error(ErrorKind::kConfig, "[engine] set_timeout(" + format_seconds(timeout_s) +
                                        " s): the timeout must be positive");
  }
  timeout_s_.store(timeout_s, std::memory_order_relaxed);
}

void Communicator::shutdown(double timeout_s) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    closing_ = true;
    if (!stop_) release_timeout_s_ = std::max(timeout_s, 0.1);
    bool drained = done_cv_.wait_until(lk, deadline_after(std::max(timeout_s, 0.0)), [&] {
      return pending_.empty();
    });
    if (!drained && !stop_) {
      size_t n = pending_.size();
      lk.unlock();
      transport_->request_abort(Error(
          ErrorKind::kAborted,
          "[engine] rank " + std::to_string(rank_) + " shut down its communicator with " +
              std::to_string(n) + " operation(s) still pending after " + format_seconds(timeout_s) +
              " s; they were cancelled; make every rank finish its operations before shutdown",
          rank_, addrs_[rank_]));
    }
  }
  stop_threads(completer_.get_id() == std::this_thread::get_id());
}

void Communicator::stop_threads(bool from_completion_thread) {
  std::lock_guard<std::mutex> guard(stop_mu_);
  if (stopped_) return;
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  queue_cv_.notify_all();
  transport_->wake();
  if (worker_.joinable()) worker_.join();
  codec_pool_.reset();
  transport_->stop_helpers();
  {
    std::lock_guard<std::mutex> lk(cmu_);
    cstop_ = true;
  }
  ccv_.notify_all();
  if (!from_completion_thread && completer_.joinable()) completer_.join();
  stopped_ = true;
}

CommStats Communicator::stats() const {
  CommStats s;
  {
    std::lock_guard<std::mutex> lk(mu_);
    s.ops_completed = ops_completed_;
  }
  s.unexpected_messages = transport_->unexpected_messages();
  s.unexpected_bytes = transport_->unexpected_bytes();
  s.linked_peers = transport_->linked_peers();
  s.link_sockets = transport_->link_sockets();
  s.per_peer.resize(size_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    uint64_t sent = transport_->bytes_sent(r), recvd = transport_->bytes_received(r);
    s.per_peer[r] = {sent, recvd};
    s.bytes_sent += sent;
    s.bytes_received += recvd;
  }
  return s;
}

}  // namespace mccl
