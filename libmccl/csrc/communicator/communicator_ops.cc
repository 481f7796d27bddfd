// The public operations of a Communicator: check the arguments in the caller's thread
// (a bad argument raises ConfigError at once and enqueues nothing, so the other ranks
// are not left waiting), then describe the op and queue it for the worker.
#include "communicator/communicator.h"
#include "reduce/reduce.h"

namespace mccl {

namespace {

// An Op's timeout_s for a p2p op's optional timeout (see Op::timeout_s).
double p2p_timeout(std::optional<double> timeout_s, const char* op) {
  if (!timeout_s) return -1;
  if (!(*timeout_s >= 0)) {
    throw_error(ErrorKind::kConfig, std::string("[") + op + "] timeout_s=" +
                                        format_seconds(*timeout_s) +
                                        " must be >= 0 (0: no deadline; omit it for the "
                                        "communicator's timeout)");
  }
  return *timeout_s;
}

}  // namespace

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

uint64_t Communicator::allreduce(void* buf, size_t count, DType dt, ReduceOp op,
                                 OpTickets tickets, uintptr_t feedback_key) {
  check_reduction(dt, op, "allreduce");
  check_ptr(buf, count, "buffer", "allreduce");
  Op o;
  o.tickets = std::move(tickets);
  o.kind = OpKind::kAllreduce;
  o.feedback_key = feedback_key;
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
                                      ReduceOp op, uintptr_t feedback_key) {
  check_reduction(dt, op, "reduce_scatter");
  check_ptr(send, count, "send", "reduce_scatter");
  check_ptr(recv, count, "recv", "reduce_scatter");
  Op o;
  o.kind = OpKind::kReduceScatter;
  o.feedback_key = feedback_key;
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

void Communicator::gate(std::shared_ptr<Ticket> ready, uint64_t base, size_t nbytes) {
  if (!ready || nbytes == 0) {
    throw_error(ErrorKind::kConfig, "[gate] needs a ready ticket and nbytes > 0");
  }
  Op o;
  o.gate = true;
  o.tickets = OpTickets{std::move(ready), nullptr, base};
  o.count = nbytes;
  enqueue(std::move(o));
}

uint64_t Communicator::barrier() {
  Op o;
  o.kind = OpKind::kBarrier;
  return enqueue(std::move(o));
}

uint64_t Communicator::send(const void* buf, size_t nbytes, int dst, int64_t tag,
                            std::optional<double> timeout_s) {
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
  o.timeout_s = p2p_timeout(timeout_s, "send");
  o.kind = OpKind::kP2P;
  o.is_send = true;
  o.buf = const_cast<void*>(buf);
  o.count = nbytes;
  o.root = dst;
  o.tag = static_cast<uint32_t>(tag);
  return enqueue(std::move(o));
}

uint64_t Communicator::recv(void* buf, size_t nbytes, int src, int64_t tag,
                            std::optional<double> timeout_s) {
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
  o.timeout_s = p2p_timeout(timeout_s, "recv");
  o.kind = OpKind::kP2P;
  o.is_send = false;
  o.buf = buf;
  o.count = nbytes;
  o.root = src;
  o.tag = static_cast<uint32_t>(tag);
  return enqueue(std::move(o));
}

}  // namespace mccl
