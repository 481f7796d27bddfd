#include "opqueue/client_queue.h"

#include <chrono>
#include <cstring>

#include "opqueue/thread_name.h"

namespace mccl::opqueue {

namespace {

// How often an idle completer re-reads the word; every real change wakes it at once.
constexpr auto kIdleSlice = std::chrono::milliseconds(500);

}  // namespace

ClientQueue::ClientQueue(const std::string& name, size_t slot_bytes, int rank, Done done)
    : slot_bytes_(slot_bytes), rank_(rank), done_(std::move(done)) {
  if (slot_bytes == 0 || slot_bytes > kMaxSlotBytes) {
    throw_error(ErrorKind::kConfig, "[opqueue] fast-path slot of " + std::to_string(slot_bytes) +
                                        " bytes on rank " + std::to_string(rank) +
                                        "; MCCL_DAEMON_FAST_BYTES must be 1..16M (0 turns it off)");
  }
  map_ = SharedMap::create(name, queue_bytes(slot_bytes));
  submitted_ = Ticket::at(map_->base() + kSubmittedOff);
  completed_ = Ticket::at(map_->base() + kCompletedOff);
  thread_ = std::thread([this] { completer_main(); });
}

ClientQueue::~ClientQueue() {
  close();
  if (thread_.joinable()) thread_.detach();  // only when destroyed by the completer itself
}

void ClientQueue::submit(uint64_t op_id, uint64_t seq, Kind kind, DType dt, ReduceOp op,
                         size_t count, void* buf) {
  const size_t nbytes = kind == Kind::kAllreduce ? count * dtype_size(dt) : 0;
  if (kind == Kind::kAllreduce && (count > slot_bytes_ / dtype_size(dt) || (nbytes && !buf))) {
    throw_error(ErrorKind::kConfig, "[opqueue] fast-path op of " + std::to_string(count) +
                                        " elements on rank " + std::to_string(rank_) +
                                        " does not fit the " + std::to_string(slot_bytes_) +
                                        "-byte slot; send it on the regular path");
  }
  std::lock_guard<std::mutex> lk(mu_);
  if (stop_) {
    throw_error(ErrorKind::kAborted, "[opqueue] rank " + std::to_string(rank_) +
                                         ": the fast-path queue is closed");
  }
  if (completed_->poisoned()) throw Error(*daemon_error());  // mccld failed the job meanwhile
  if (inflight_) {
    throw_error(ErrorKind::kConfig, "[opqueue] rank " + std::to_string(rank_) +
                                        ": submit while an op is in flight; one at a time");
  }
  if (nbytes) std::memcpy(map_->base() + kDataOff, buf, nbytes);
  Entry e{seq, static_cast<uint32_t>(kind), static_cast<uint32_t>(dt), static_cast<uint32_t>(op), 0,
          kind == Kind::kAllreduce ? static_cast<uint64_t>(count) : 0};
  std::memcpy(map_->base() + kEntryOff, &e, sizeof e);
  op_id_ = op_id;
  buf_ = buf;
  nbytes_ = nbytes;
  inflight_ = true;
  submitted_->signal(++published_);  // release: the entry and the data are visible first
  cv_.notify_one();
}

void ClientQueue::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_) return;
    stop_ = true;
    cv_.notify_one();
  }
  // The daemon never waits on `completed`, so poisoning our view of it only wakes the completer.
  completed_->poison();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

std::shared_ptr<const Error> ClientQueue::daemon_error() const {
  ErrorRecord rec;
  std::memcpy(&rec, map_->base() + kErrorOff, sizeof rec);
  if (rec.msg_len == 0 || rec.msg_len > kErrorMsgMax || rec.addr_len > sizeof rec.peer_addr) {
    return std::make_shared<Error>(ErrorKind::kAborted,
                                   "[daemon-client] mccld failed the job's fast path on rank " +
                                       std::to_string(rank_) + " without a reason; see its log");
  }
  auto kind = static_cast<ErrorKind>(rec.kind >= 0 && rec.kind <= kLastKind ? rec.kind : 0);
  return std::make_shared<Error>(kind, std::string(rec.msg, rec.msg_len), rec.peer_rank,
                                 std::string(rec.peer_addr, rec.addr_len));
}

void ClientQueue::completer_main() {
  name_this_thread("mccl-fastq");
  while (true) {
    uint64_t target, op_id;
    void* buf;
    size_t nbytes;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [this] { return stop_ || inflight_; });
      if (stop_) return;
      target = published_;
      op_id = op_id_;
      buf = buf_;
      nbytes = nbytes_;
    }
    Ticket::Wait w;
    do {
      w = completed_->wait_until(target, Clock::now() + kIdleSlice, kIdleSlice);
    } while (w == Ticket::Wait::kTimeout);
    std::shared_ptr<const Error> err;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (stop_) return;  // closed: the owner reports the op itself
      if (w == Ticket::Wait::kReached) {
        if (nbytes) std::memcpy(buf, map_->base() + kDataOff, nbytes);
      } else {
        err = daemon_error();
      }
      inflight_ = false;
    }
    done_(op_id, err);
    if (err) return;
  }
}

}  // namespace mccl::opqueue
