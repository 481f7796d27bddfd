#include "communicator.h"

#include <algorithm>
#include <cstdio>

#include "algorithms/algorithms.h"
#include "reduce.h"
#include "transport/mesh.h"

namespace mccl {

namespace {

// Scratch slots up to this size stay allocated between ops (a DDP bucket is 25 MB);
// bigger ones are freed after their op.
constexpr size_t kKeepScratchBytes = 64 << 20;

std::string seconds_str(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s);
  return buf;
}

}  // namespace

void Options::validate() const {
  auto bad = [](const std::string& what) {
    throw_error(ErrorKind::kConfig, "[engine] invalid option " + what);
  };
  if (sockets_per_peer < 1 || sockets_per_peer > 16) {
    bad("sockets_per_peer=" + std::to_string(sockets_per_peer) + ": must be 1..16 (MCCL_SOCKETS_PER_PEER)");
  }
  if (socket_buffer_bytes < (64 << 10)) {
    bad("socket_buffer_bytes=" + std::to_string(socket_buffer_bytes) +
        ": must be at least 64K (MCCL_SOCKET_BUFFER_BYTES)");
  }
  if (segment_bytes != 0 && segment_bytes < (4 << 10)) {
    bad("segment_bytes=" + std::to_string(segment_bytes) + ": must be 0 or at least 4K (MCCL_SEGMENT_BYTES)");
  }
  if (!(timeout_s > 0)) bad("timeout_s=" + seconds_str(timeout_s) + ": must be positive");
  if (!(connect_timeout_s > 0)) {
    bad("connect_timeout_s=" + seconds_str(connect_timeout_s) + ": must be positive");
  }
}

Communicator::Communicator(int rank, int size, uint64_t comm_id, int listen_fd,
                           std::vector<std::string> peer_addrs, const Options& opts,
                           Deliver deliver)
    : rank_(rank),
      size_(size),
      comm_id_(comm_id),
      opts_(opts),
      addrs_(std::move(peer_addrs)),
      deliver_(std::move(deliver)) {
  opts_.validate();
  if (size < 1 || rank < 0 || rank >= size) {
    throw_error(ErrorKind::kConfig, "[engine] rank " + std::to_string(rank) +
                                        " is outside a world of size " + std::to_string(size));
  }
  if (static_cast<int>(addrs_.size()) != size) {
    throw_error(ErrorKind::kConfig, "[engine] got " + std::to_string(addrs_.size()) +
                                        " peer addresses for a world of size " +
                                        std::to_string(size) + "; pass one per rank");
  }
  MeshSpec spec;
  spec.rank = rank;
  spec.size = size;
  spec.comm_id = comm_id;
  spec.sockets_per_peer = opts_.sockets_per_peer;
  spec.socket_buffer_bytes = opts_.socket_buffer_bytes;
  spec.peer_addrs = addrs_;
  auto links = build_mesh(spec, listen_fd, deadline_after(opts_.connect_timeout_s));
  transport_ = std::make_unique<Transport>(rank, size, comm_id, std::move(links), addrs_);
  worker_ = std::thread([this] { worker_main(); });
  completer_ = std::thread([this] { completion_main(); });
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

void Communicator::check_root(int root, const char* op) const {
  if (root < 0 || root >= size_) {
    throw_error(ErrorKind::kConfig, std::string("[") + op + "] root " + std::to_string(root) +
                                        " is outside a world of size " + std::to_string(size_));
  }
}

void Communicator::check_ptr(const void* p, size_t n, const char* what, const char* op) const {
  if (n > 0 && p == nullptr) {
    throw_error(ErrorKind::kConfig, std::string("[") + op + "] " + what + " pointer is null for " +
                                        std::to_string(n) + " bytes");
  }
}

void Communicator::check_reduction(DType dt, ReduceOp op, const char* name) const {
  if (!reduce_supported(dt, op)) {
    reduce_fn(dt, op);  // throws the reductions' own explanation
    throw_error(ErrorKind::kConfig, std::string("[") + name + "] " + reduce_op_name(op) +
                                        " is not supported on " + dtype_name(dt));
  }
}

uint64_t Communicator::enqueue(Op op) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closing_) {
      throw_error(ErrorKind::kAborted,
                  std::string("[engine] ") + op_kind_name(op.kind) +
                      " called on a communicator that is shut down or aborted; create a new "
                      "process group");
    }
    id = next_id_++;
    op.id = id;
    pending_.insert(id);
    queue_.push_back(std::move(op));
  }
  queue_cv_.notify_one();
  transport_->wake();
  return id;
}

uint64_t Communicator::allreduce(void* buf, size_t count, DType dt, ReduceOp op) {
  check_reduction(dt, op, "allreduce");
  check_ptr(buf, count, "buffer", "allreduce");
  Op o;
  o.kind = OpKind::kAllreduce;
  o.buf = buf;
  o.count = count;
  o.dtype = dt;
  o.op = op;
  return enqueue(std::move(o));
}

uint64_t Communicator::broadcast(void* buf, size_t nbytes, int root) {
  check_root(root, "broadcast");
  check_ptr(buf, nbytes, "buffer", "broadcast");
  Op o;
  o.kind = OpKind::kBroadcast;
  o.buf = buf;
  o.count = nbytes;
  o.root = root;
  return enqueue(std::move(o));
}

uint64_t Communicator::allgather(const void* send, void* recv, size_t nbytes) {
  check_ptr(send, nbytes, "send", "allgather");
  check_ptr(recv, nbytes, "recv", "allgather");
  Op o;
  o.kind = OpKind::kAllgather;
  o.buf = const_cast<void*>(send);
  o.out = recv;
  o.count = nbytes;
  return enqueue(std::move(o));
}

uint64_t Communicator::reduce_scatter(const void* send, void* recv, size_t count, DType dt,
                                      ReduceOp op) {
  check_reduction(dt, op, "reduce_scatter");
  check_ptr(send, count, "send", "reduce_scatter");
  check_ptr(recv, count, "recv", "reduce_scatter");
  Op o;
  o.kind = OpKind::kReduceScatter;
  o.buf = const_cast<void*>(send);
  o.out = recv;
  o.count = count;
  o.dtype = dt;
  o.op = op;
  return enqueue(std::move(o));
}

uint64_t Communicator::reduce(void* buf, size_t count, DType dt, ReduceOp op, int root) {
  check_reduction(dt, op, "reduce");
  check_root(root, "reduce");
  check_ptr(buf, count, "buffer", "reduce");
  Op o;
  o.kind = OpKind::kReduce;
  o.buf = buf;
  o.count = count;
  o.dtype = dt;
  o.op = op;
  o.root = root;
  return enqueue(std::move(o));
}

uint64_t Communicator::gather(const void* send, void* recv, size_t nbytes, int root) {
  check_root(root, "gather");
  check_ptr(send, nbytes, "send", "gather");
  if (rank_ == root) check_ptr(recv, nbytes, "recv (on the root)", "gather");
  Op o;
  o.kind = OpKind::kGather;
  o.buf = const_cast<void*>(send);
  o.out = recv;
  o.count = nbytes;
  o.root = root;
  return enqueue(std::move(o));
}

uint64_t Communicator::scatter(const void* send, void* recv, size_t nbytes, int root) {
  check_root(root, "scatter");
  if (rank_ == root) check_ptr(send, nbytes, "send (on the root)", "scatter");
  check_ptr(recv, nbytes, "recv", "scatter");
  Op o;
  o.kind = OpKind::kScatter;
  o.buf = const_cast<void*>(send);
  o.out = recv;
  o.count = nbytes;
  o.root = root;
  return enqueue(std::move(o));
}

uint64_t Communicator::alltoall(const void* send, void* recv, size_t nbytes) {
  check_ptr(send, nbytes, "send", "alltoall");
  check_ptr(recv, nbytes, "recv", "alltoall");
  Op o;
  o.kind = OpKind::kAlltoall;
  o.buf = const_cast<void*>(send);
  o.out = recv;
  o.count = nbytes;
  return enqueue(std::move(o));
}

uint64_t Communicator::alltoallv(const void* send, std::vector<size_t> send_sizes,
                                 std::vector<size_t> send_offsets, void* recv,
                                 std::vector<size_t> recv_sizes,
                                 std::vector<size_t> recv_offsets) {
  const size_t n = static_cast<size_t>(size_);
  if (send_sizes.size() != n || send_offsets.size() != n || recv_sizes.size() != n ||
      recv_offsets.size() != n) {
    throw_error(ErrorKind::kConfig, "[alltoallv] sizes and offsets need one entry per rank (" +
                                        std::to_string(n) + ")");
  }
  if (send_sizes[rank_] != recv_sizes[rank_]) {
    throw_error(ErrorKind::kConfig,
                "[alltoallv] this rank sends " + std::to_string(send_sizes[rank_]) +
                    " bytes to itself but expects " + std::to_string(recv_sizes[rank_]) +
                    "; the sizes of the block a rank keeps must agree");
  }
  size_t st = 0, rt = 0;
  for (size_t q = 0; q < n; ++q) {
    st += send_sizes[q];
    rt += recv_sizes[q];
  }
  check_ptr(send, st, "send", "alltoallv");
  check_ptr(recv, rt, "recv", "alltoallv");
  Op o;
  o.kind = OpKind::kAlltoallv;
  o.buf = const_cast<void*>(send);
  o.out = recv;
  o.send_sizes = std::move(send_sizes);
  o.send_offsets = std::move(send_offsets);
  o.recv_sizes = std::move(recv_sizes);
  o.recv_offsets = std::move(recv_offsets);
  return enqueue(std::move(o));
}

uint64_t Communicator::barrier() {
  Op o;
  o.kind = OpKind::kBarrier;
  return enqueue(std::move(o));
}

uint64_t Communicator::send(const void* buf, size_t nbytes, int dst, int64_t tag) {
  if (dst < 0 || dst >= size_ || dst == rank_) {
    throw_error(ErrorKind::kConfig, "[send] destination rank " + std::to_string(dst) +
                                        " is invalid (world size " + std::to_string(size_) +
                                        ", this rank " + std::to_string(rank_) + ")");
  }
  if (tag < 0 || tag > int64_t(UINT32_MAX)) {
    throw_error(ErrorKind::kConfig, "[send] tag " + std::to_string(tag) + " must be 0..2^32-1");
  }
  check_ptr(buf, nbytes, "buffer", "send");
  Op o;
  o.kind = OpKind::kP2P;
  o.is_send = true;
  o.buf = const_cast<void*>(buf);
  o.count = nbytes;
  o.root = dst;
  o.tag = static_cast<uint32_t>(tag);
  return enqueue(std::move(o));
}

uint64_t Communicator::recv(void* buf, size_t nbytes, int src, int64_t tag) {
  if (src < -1 || src >= size_ || src == rank_) {
    throw_error(ErrorKind::kConfig, "[recv] source rank " + std::to_string(src) +
                                        " is invalid (world size " + std::to_string(size_) +
                                        ", this rank " + std::to_string(rank_) + "; -1: any)");
  }
  if (tag < 0 || tag > int64_t(UINT32_MAX)) {
    throw_error(ErrorKind::kConfig, "[recv] tag " + std::to_string(tag) + " must be 0..2^32-1");
  }
  check_ptr(buf, nbytes, "buffer", "recv");
  Op o;
  o.kind = OpKind::kP2P;
  o.is_send = false;
  o.buf = buf;
  o.count = nbytes;
  o.root = src;
  o.tag = static_cast<uint32_t>(tag);
  return enqueue(std::move(o));
}

// ---------------------------------------------------------------- the worker

void Communicator::worker_main() {
  while (true) {
    Op op;
    bool have = false;
    {
      std::unique_lock<std::mutex> lk(mu_);
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
    } else {
      transport_->close_gracefully(deadline_after(1.0));
    }
  }
}

void Communicator::run(Op& op) {
  std::shared_ptr<const Error> sticky;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sticky = sticky_;
  }
  if (sticky) {
    complete(op.id, sticky, -1);
    return;
  }
  try {
    if (op.kind == OpKind::kP2P) {
      post_p2p(op);
    } else {
      run_collective(op);
      complete(op.id, nullptr, -1);
    }
  } catch (const Error& e) {
    on_error(e);
    std::lock_guard<std::mutex> lk(mu_);
    sticky = sticky_;
  } catch (const std::exception& e) {
    on_error(Error(ErrorKind::kGeneric, std::string("[engine] internal error in ") +
                                            op_kind_name(op.kind) + ": " + e.what()));
    std::lock_guard<std::mutex> lk(mu_);
    sticky = sticky_;
  }
  if (sticky) {
    bool still_pending;
    {
      std::lock_guard<std::mutex> lk(mu_);
      still_pending = pending_.count(op.id) > 0;
    }
    if (still_pending) complete(op.id, sticky, -1);
  }
}

void Communicator::run_collective(Op& op) {
  Signature sig;
  sig.kind = op.kind;
  const size_t es = dtype_size(op.dtype);
  switch (op.kind) {
    case OpKind::kAllreduce:
    case OpKind::kReduceScatter:
    case OpKind::kReduce:
      sig.op_bytes = op.count * es;
      sig.dtype = static_cast<uint8_t>(op.dtype);
      sig.redop = static_cast<uint8_t>(op.op);
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
  transport_->begin_collective(coll_seq_++, sig);
  Collective c{*transport_, deadline_after(opts_.timeout_s), opts_.timeout_s, opts_, scratch_};
  switch (op.kind) {
    case OpKind::kAllreduce: mccl::allreduce(c, op.buf, op.count, op.dtype, op.op); break;
    case OpKind::kBroadcast: mccl::broadcast(c, op.buf, op.count, op.root); break;
    case OpKind::kAllgather: mccl::allgather_ring(c, op.buf, op.out, op.count); break;
    case OpKind::kReduceScatter:
      mccl::reduce_scatter_ring(c, op.buf, op.out, op.count, op.dtype, op.op);
      break;
    case OpKind::kReduce: mccl::reduce_to_root(c, op.buf, op.count, op.dtype, op.op, op.root); break;
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

void Communicator::post_p2p(const Op& op) {
  const uint64_t id = op.id;
  p2p_deadlines_[id] = deadline_after(opts_.timeout_s);
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
  for (auto& kv : p2p_deadlines_) until = std::min(until, kv.second);
  try {
    transport_->progress(until);
    auto now = Clock::now();
    for (auto& kv : p2p_deadlines_) {
      if (kv.second <= now) transport_->p2p_timeout(opts_.timeout_s);
    }
  } catch (const Error& e) {
    on_error(e);
  }
}

void Communicator::on_error(const Error& e) {
  transport_->fail(e);  // idempotent: the first failure wins and is what peers hear
  std::shared_ptr<const Error> err = transport_->failure();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!sticky_) {
      sticky_ = err;
      failed_from_ = next_id_;
    }
  }
  scratch_.release();
}

void Communicator::complete(uint64_t id, std::shared_ptr<const Error> err, int info) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!pending_.erase(id)) return;
    if (err) failed_ops_[id] = err;
    ++ops_completed_;
  }
  done_cv_.notify_all();
  {
    std::lock_guard<std::mutex> lk(cmu_);
    completions_.push_back({id, std::move(err), info});
  }
  ccv_.notify_one();
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

void Communicator::wait(uint64_t id, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (id == 0 || id >= next_id_) {
    throw_error(ErrorKind::kConfig, "[engine] wait: no operation #" + std::to_string(id));
  }
  bool done = done_cv_.wait_until(lk, deadline_after(timeout_s), [&] { return !pending_.count(id); });
  if (!done) {
    throw_error(ErrorKind::kTimeout, "[engine] waiting for op #" + std::to_string(id) +
                                         " timed out after " + seconds_str(timeout_s) +
                                         " s; it is still running; wait longer or check the "
                                         "other ranks reached the same op");
  }
  auto it = failed_ops_.find(id);
  if (it != failed_ops_.end()) throw Error(*it->second);
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

void Communicator::shutdown(double timeout_s) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    closing_ = true;
    bool drained = done_cv_.wait_until(lk, deadline_after(std::max(timeout_s, 0.0)), [&] {
      return pending_.empty();
    });
    if (!drained && !stop_) {
      size_t n = pending_.size();
      lk.unlock();
      transport_->request_abort(Error(
          ErrorKind::kAborted,
          "[engine] rank " + std::to_string(rank_) + " shut down its communicator with " +
              std::to_string(n) + " operation(s) still pending after " + seconds_str(timeout_s) +
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
