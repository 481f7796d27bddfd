#include "opqueue/dispatcher.h"

#include <algorithm>
#include <cstring>

#include "core/thread_name.h"

#include "reduce/reduce.h"
#include "transport/socket.h"

namespace mccl::opqueue {

namespace {

// An idle job's thread re-reads its first queue this often (a submission wakes it at once).
constexpr auto kIdleSlice = std::chrono::milliseconds(250);
// A fast op may wait behind slow ones (each bounded by the job's timeout: the wait for its
// submissions, then its engine op); past this many timeouts something is lost.
constexpr double kTurnTimeouts = 3.0;
constexpr size_t kRecordsKept = 4096;

const char* kind_name(uint32_t k) {
  return k == static_cast<uint32_t>(Kind::kAllreduce) ? "all_reduce"
         : k == static_cast<uint32_t>(Kind::kBarrier) ? "barrier"
                                                      : "?";
}

std::string describe(const Entry& e) {
  if (e.kind == static_cast<uint32_t>(Kind::kBarrier)) return "barrier";
  return std::string(kind_name(e.kind)) + "(count=" + std::to_string(e.count) +
         ", dtype=" + std::to_string(e.dtype) + ", op=" + std::to_string(e.op) + ")";
}

void write_error(uint8_t* base, const Error& e, uint64_t completed) {
  ErrorRecord rec{};
  rec.completed = completed;
  rec.kind = static_cast<int32_t>(e.kind());
  rec.peer_rank = e.peer_rank();
  std::string msg = e.what();
  rec.msg_len = static_cast<uint32_t>(std::min(msg.size(), kErrorMsgMax));
  std::memcpy(rec.msg, msg.data(), rec.msg_len);
  rec.addr_len = static_cast<uint32_t>(std::min(e.peer_addr().size(), sizeof rec.peer_addr));
  std::memcpy(rec.peer_addr, e.peer_addr().data(), rec.addr_len);
  std::memcpy(base + kErrorOff, &rec, sizeof rec);
}

}  // namespace

Dispatcher::Dispatcher(DispatcherSpec spec, Communicator* engine, OnFail on_fail)
    : spec_(std::move(spec)), engine_(engine), on_fail_(std::move(on_fail)),
      turn_(std::make_shared<Ticket>()) {
  if (spec_.local_ranks.empty() || spec_.local_ranks.size() != spec_.queues.size() ||
      spec_.queue_fds.size() != spec_.queues.size() ||
      spec_.slot_bytes == 0 || spec_.slot_bytes > kMaxSlotBytes || spec_.world < 1 ||
      spec_.hosts < 1 || (spec_.hosts > 1) != (engine != nullptr)) {
    throw_error(ErrorKind::kConfig, "[daemon] job " + spec_.job +
                                        ": inconsistent fast-path set-up (ranks, queues, slot "
                                        "size, engine); this is a bug in mccld");
  }
  for (size_t i = 0; i < spec_.queues.size(); ++i) {
    Queue q;
    q.rank = spec_.local_ranks[i];
    q.map = SharedMap::adopt(spec_.queue_fds[i], spec_.queues[i], queue_bytes(spec_.slot_bytes));
    q.submitted = Ticket::at(q.map->base() + kSubmittedOff);
    q.completed = Ticket::at(q.map->base() + kCompletedOff);
    queues_.push_back(std::move(q));
  }
  thread_ = std::thread([this] { main(); });
}

Dispatcher::~Dispatcher() { close(); }

void Dispatcher::fail(const Error& e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (failed_) return;
    failed_ = true;
  }
  stop_.store(true, std::memory_order_release);
  for (auto& q : queues_) {
    // Read before the poison: the dispatcher thread only raises it, so at worst an op that
    // finished this instant is reported failed, never the other way round.
    write_error(q.map->base(), e, q.completed->value());
    q.completed->poison();  // release: the record is visible to a client that sees the poison
    q.submitted->poison();
  }
  turn_->poison();
}

void Dispatcher::close() {
  if (!stop_.exchange(true)) {
    // Wakes the thread wherever it sleeps; the clients are gone or their job failed.
    for (auto& q : queues_) q.submitted->poison();
    turn_->poison();
  }
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

std::vector<OpRecord> Dispatcher::take_records() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<OpRecord> out;
  out.swap(records_);
  return out;
}

void Dispatcher::protocol_error(int rank, uint64_t n, const std::string& what) const {
  throw_error(ErrorKind::kProtocol, "[daemon] job " + spec_.job + " rank " + std::to_string(rank) +
                                        ": fast-path entry #" + std::to_string(n) + " " + what +
                                        "; the client is out of sync with this mccld or wrote "
                                        "over its queue; restart the job",
              rank);
}

void Dispatcher::main() {
  name_this_thread("mccld-fastpath");
  uint64_t n = 0;  // fast ops served
  while (!stopping()) {
    bool from_engine = false;
    try {
      wait_entries(n + 1);
      if (stopping()) return;
      const Entry lead = read_entry(queues_[0], n + 1);
      for (size_t i = 1; i < queues_.size(); ++i) {
        check_same(lead, read_entry(queues_[i], n + 1), queues_[i].rank);
      }
      if (lead.seq <= last_seq_) {
        protocol_error(queues_[0].rank, n + 1, "reuses sequence number " +
                                                   std::to_string(lead.seq) + " (last served " +
                                                   std::to_string(last_seq_) + ")");
      }
      wait_turn(lead.seq);
      if (stopping()) return;
      auto started = Clock::now();
      from_engine = true;
      run(lead);
      from_engine = false;
      ++n;
      last_seq_ = lead.seq;
      for (auto& q : queues_) q.completed->signal(n);
      turn_->signal(lead.seq);
      double secs = std::chrono::duration<double>(Clock::now() - started).count();
      std::lock_guard<std::mutex> lk(mu_);
      if (records_.size() < kRecordsKept) {
        records_.push_back({static_cast<Kind>(lead.kind), lead.count * dtype_size(static_cast<DType>(lead.dtype)) *
                                                              (lead.kind == static_cast<uint32_t>(Kind::kAllreduce)),
                            secs});
      }
    } catch (const Error& e) {
      if (!stopping()) {
        try {
          on_fail_(e, from_engine);  // the owner fails us with its verdict: fail(e) is then a no-op
        } catch (...) {
          // The owner could not take the verdict: fail on our own below.
        }
        fail(e);
      }
      return;
    } catch (const std::exception& e) {
      if (!stopping()) {
        Error err(ErrorKind::kGeneric, std::string("[daemon] job ") + spec_.job +
                                           ": fast-path dispatcher failed: " + e.what());
        try {
          on_fail_(err, false);
        } catch (...) {
        }
        fail(err);
      }
      return;
    }
  }
}

void Dispatcher::wait_entries(uint64_t n) {
  // Idle until any local rank publishes; from then on the others have the job's timeout.
  Deadline first_seen = Deadline::max();
  while (!stopping()) {
    const Queue* missing = nullptr;
    for (const auto& q : queues_) {
      uint64_t v = q.submitted->value();
      if (v == Ticket::kPoison) return;  // fail() or close(): stopping() says so
      if (v > n) protocol_error(q.rank, n, "was published before #" + std::to_string(n - 1) + " completed");
      if (v < n) {
        if (!missing) missing = &q;
      } else if (first_seen == Deadline::max()) {
        first_seen = Clock::now();
      }
    }
    if (!missing) return;
    Deadline until = Clock::now() + kIdleSlice;
    if (first_seen != Deadline::max()) {
      Deadline limit = first_seen + std::chrono::duration_cast<Clock::duration>(
                                        std::chrono::duration<double>(spec_.timeout_s));
      if (Clock::now() >= limit) {
        std::string who;
        for (const auto& q : queues_) {
          if (q.submitted->value() < n) who += (who.empty() ? "" : ", ") + std::to_string(q.rank);
        }
        throw_error(ErrorKind::kTimeout,
                    "[daemon] Timed out after " + format_seconds(spec_.timeout_s) + " s in job " +
                        spec_.job + ": local rank(s) [" + who +
                        "] did not submit their next small collective while other local ranks "
                        "waited in it; a rank is stuck or took another code path",
                    missing->rank);
      }
      until = std::min(until, limit);
    }
    missing->submitted->wait_until(n, until, kIdleSlice);
  }
}

Entry Dispatcher::read_entry(const Queue& q, uint64_t n) const {
  Entry e;
  std::memcpy(&e, q.map->base() + kEntryOff, sizeof e);  // once: the client may write on
  if (e.kind == static_cast<uint32_t>(Kind::kBarrier)) {
    e.dtype = static_cast<uint32_t>(DType::kUInt8);
    e.op = static_cast<uint32_t>(ReduceOp::kSum);
    e.count = 0;
  } else if (e.kind == static_cast<uint32_t>(Kind::kAllreduce)) {
    if (!dtype_is_valid(static_cast<int>(e.dtype)) || !reduce_op_is_valid(static_cast<int>(e.op)) ||
        !reduce_supported(static_cast<DType>(e.dtype), static_cast<ReduceOp>(e.op))) {
      protocol_error(q.rank, n, "has dtype " + std::to_string(e.dtype) + " and reduce op " +
                                    std::to_string(e.op) + ", not a supported pair");
    }
    if (e.count > spec_.slot_bytes / dtype_size(static_cast<DType>(e.dtype))) {
      protocol_error(q.rank, n, "claims " + std::to_string(e.count) + " elements, more than its " +
                                    std::to_string(spec_.slot_bytes) + "-byte slot holds");
    }
  } else {
    protocol_error(q.rank, n, "has unknown kind " + std::to_string(e.kind));
  }
  if (e.seq == 0) protocol_error(q.rank, n, "has sequence number 0");
  return e;
}

void Dispatcher::check_same(const Entry& lead, const Entry& e, int other) const {
  if (lead.seq == e.seq && lead.kind == e.kind && lead.dtype == e.dtype && lead.op == e.op &&
      lead.count == e.count) {
    return;
  }
  const int first = queues_[0].rank;
  throw_error(ErrorKind::kMismatch,
              "[daemon] job " + spec_.job + ": rank " + std::to_string(other) + "'s collective #" +
                  std::to_string(e.seq) + " is " + describe(e) + " while rank " +
                  std::to_string(first) + "'s collective #" + std::to_string(lead.seq) + " is " +
                  describe(lead) +
                  "; every rank must issue the same collectives in the same order (a different "
                  "size or MCCL_DAEMON_FAST_BYTES sends one of them another way)",
              other);
}

void Dispatcher::wait_turn(uint64_t seq) {
  const double limit_s = spec_.timeout_s * kTurnTimeouts;
  Deadline limit = deadline_after(limit_s);
  while (!stopping()) {
    uint64_t t = turn_->value();
    if (t == Ticket::kPoison) return;
    if (t >= seq) {
      protocol_error(queues_[0].rank, 0, "has sequence number " + std::to_string(seq) +
                                             ", which the job already ran (turn " +
                                             std::to_string(t) + ")");
    }
    if (t == seq - 1) return;
    if (Clock::now() >= limit) {
      throw_error(ErrorKind::kTimeout,
                  "[daemon] Timed out after " + format_seconds(limit_s) + " s in job " + spec_.job +
                      ": small collective #" + std::to_string(seq) + " waited for collective #" +
                      std::to_string(t + 1) +
                      " on mccld's regular path, which never finished; see the daemon's log");
    }
    turn_->wait_until(seq - 1, std::min(limit, Clock::now() + kIdleSlice), kIdleSlice);
  }
}

void Dispatcher::run(const Entry& e) {
  // The engine op's own deadline decides; this bound only catches a wedged engine.
  const double wait_s = Communicator::own_error_bound_s(spec_.timeout_s);
  if (e.kind == static_cast<uint32_t>(Kind::kBarrier)) {
    if (engine_) engine_->wait(engine_->barrier(), wait_s);
    return;
  }
  const auto dt = static_cast<DType>(e.dtype);
  const auto op = static_cast<ReduceOp>(e.op);
  const size_t count = e.count, nbytes = count * dtype_size(dt);
  const bool avg = op == ReduceOp::kAvg;
  uint8_t* lead = queues_[0].data();
  if (queues_.size() > 1 && count) {
    ReduceFn fn = reduce_fn(dt, avg ? ReduceOp::kSum : op);
    for (size_t i = 1; i < queues_.size(); ++i) fn(queues_[i].data(), lead, count);
  }
  // The engine's AVG divides by its own size: right only with one rank on every host.
  const bool engine_divides = avg && spec_.world == spec_.hosts;
  if (engine_) {
    ReduceOp engine_op = avg && !engine_divides ? ReduceOp::kSum : op;
    engine_->wait(engine_->allreduce(lead, count, dt, engine_op), wait_s);
  }
  if (avg && !(engine_ && engine_divides)) finalize_avg(lead, count, dt, spec_.world);
  for (size_t i = 1; i < queues_.size(); ++i) std::memcpy(queues_[i].data(), lead, nbytes);
}

}  // namespace mccl::opqueue
