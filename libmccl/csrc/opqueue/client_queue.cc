#include "opqueue/client_queue.h"

#include <chrono>
#include <cstddef>
#include <cstring>

#include "core/thread_name.h"

namespace mccl::opqueue {

namespace {

// How often an idle completer re-reads the word; every real change wakes it at once.
constexpr auto kIdleSlice = std::chrono::milliseconds(500);

}  // namespace

ClientQueue::ClientQueue(const std::string& name, size_t slot_bytes, int rank, Done done)
    : s_(std::make_shared<State>()) {
  if (slot_bytes == 0 || slot_bytes > kMaxSlotBytes) {
    throw_error(ErrorKind::kConfig, "[opqueue] fast-path slot of " + std::to_string(slot_bytes) +
                                        " bytes on rank " + std::to_string(rank) +
                                        "; MCCL_DAEMON_FAST_BYTES must be 1..16M (0 turns it off)");
  }
  s_->slot_bytes = slot_bytes;
  s_->rank = rank;
  s_->done = std::move(done);
  s_->map = SharedMap::create(name, queue_bytes(slot_bytes));
  s_->submitted = Ticket::at(s_->map->base() + kSubmittedOff);
  s_->completed = Ticket::at(s_->map->base() + kCompletedOff);
  thread_ = std::thread(completer_main, s_);
}

ClientQueue::~ClientQueue() {
  close();
  if (thread_.joinable()) thread_.detach();  // destroyed on the completer: it ends on its own
}

void ClientQueue::submit(uint64_t op_id, uint64_t seq, Kind kind, DType dt, ReduceOp op,
                         size_t count, void* buf) {
  State& s = *s_;
  const size_t nbytes = kind == Kind::kAllreduce ? count * dtype_size(dt) : 0;
  if (kind == Kind::kAllreduce && (count > s.slot_bytes / dtype_size(dt) || (nbytes && !buf))) {
    throw_error(ErrorKind::kConfig, "[opqueue] fast-path op of " + std::to_string(count) +
                                        " elements on rank " + std::to_string(s.rank) +
                                        " does not fit the " + std::to_string(s.slot_bytes) +
                                        "-byte slot; send it on the regular path");
  }
  std::lock_guard<std::mutex> lk(s.mu);
  if (s.stop) {
    throw_error(ErrorKind::kAborted, "[opqueue] rank " + std::to_string(s.rank) +
                                         ": the fast-path queue is closed");
  }
  if (s.completed->poisoned()) throw Error(*s.daemon_error());  // mccld failed the job meanwhile
  if (s.inflight) {
    throw_error(ErrorKind::kConfig, "[opqueue] rank " + std::to_string(s.rank) +
                                        ": submit while an op is in flight; one at a time");
  }
  uint8_t* base = s.map->base();
  if (nbytes) std::memcpy(base + kDataOff, buf, nbytes);
  Entry e{seq, static_cast<uint32_t>(kind), static_cast<uint32_t>(dt), static_cast<uint32_t>(op), 0,
          kind == Kind::kAllreduce ? static_cast<uint64_t>(count) : 0};
  std::memcpy(base + kEntryOff, &e, sizeof e);
  s.op_id = op_id;
  s.buf = buf;
  s.nbytes = nbytes;
  s.inflight = true;
  s.submitted->signal(++s.published);  // release: the entry and the data are visible first
  s.cv.notify_one();
}

void ClientQueue::close() {
  {
    std::lock_guard<std::mutex> lk(s_->mu);
    if (s_->stop) return;
    s_->stop = true;
    s_->cv.notify_one();
  }
  // The daemon never waits on `completed`, so poisoning our view of it only wakes the completer.
  s_->completed->poison();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

std::shared_ptr<const Error> ClientQueue::State::daemon_error() const {
  ErrorRecord rec;
  std::memcpy(&rec, map->base() + kErrorOff, sizeof rec);
  if (rec.msg_len == 0 || rec.msg_len > kErrorMsgMax || rec.addr_len > sizeof rec.peer_addr) {
    return std::make_shared<Error>(ErrorKind::kAborted,
                                   "[daemon-client] mccld failed the job's fast path on rank " +
                                       std::to_string(rank) + " without a reason; see its log");
  }
  auto kind = static_cast<ErrorKind>(rec.kind >= 0 && rec.kind <= kLastKind ? rec.kind : 0);
  return std::make_shared<Error>(kind, std::string(rec.msg, rec.msg_len), rec.peer_rank,
                                 std::string(rec.peer_addr, rec.addr_len));
}

uint64_t ClientQueue::State::completed_before_failure() const {
  uint64_t v;
  std::memcpy(&v, map->base() + kErrorOff + offsetof(ErrorRecord, completed), sizeof v);
  return v == Ticket::kPoison ? 0 : v;
}

void ClientQueue::completer_main(std::shared_ptr<State> sp) {
  name_this_thread("mccl-fastq");
  State& s = *sp;
  while (true) {
    uint64_t target, op_id;
    void* buf;
    size_t nbytes;
    {
      std::unique_lock<std::mutex> lk(s.mu);
      s.cv.wait(lk, [&s] { return s.stop || s.inflight; });
      if (s.stop) return;
      target = s.published;
      op_id = s.op_id;
      buf = s.buf;
      nbytes = s.nbytes;
    }
    Ticket::Wait w;
    do {
      w = s.completed->wait_until(target, Clock::now() + kIdleSlice, kIdleSlice);
    } while (w == Ticket::Wait::kTimeout);
    if (w == Ticket::Wait::kPoisoned && s.completed_before_failure() >= target) {
      w = Ticket::Wait::kReached;  // the job failed after this op finished: its result stands
    }
    std::shared_ptr<const Error> err;
    {
      std::lock_guard<std::mutex> lk(s.mu);
      if (s.stop) return;  // closed: the owner reports the op itself
      if (w == Ticket::Wait::kReached) {
        if (nbytes) std::memcpy(buf, s.map->base() + kDataOff, nbytes);
      } else {
        err = s.daemon_error();
      }
      s.inflight = false;
    }
    s.done(op_id, err);
    if (err) return;
  }
}

}  // namespace mccl::opqueue
