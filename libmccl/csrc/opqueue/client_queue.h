// The client's end of its small-op queue to mccld (layout.h). `submit` publishes one op
// from the calling thread; a completer thread sleeps on the `completed` ticket, copies the
// result out and reports it through `Done` (the Python binding takes the GIL there, once
// per op, like the in-process engine's completion thread). One op at a time: the caller
// submits the next only after the previous one was reported.
//
// The completer has no deadline of its own: the caller owns the op's deadline (its
// daemon client already watches the control channel and the clock) and ends a late or
// orphaned op with close(), which poisons `completed` locally to wake the completer.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/dtype.h"
#include "core/errors.h"
#include "opqueue/layout.h"
#include "opqueue/shm_map.h"
#include "core/ticket.h"

namespace mccl::opqueue {

class ClientQueue {
 public:
  // err null: success. Runs on the completer thread.
  using Done = std::function<void(uint64_t op_id, std::shared_ptr<const Error> err)>;

  ClientQueue(const std::string& name, size_t slot_bytes, int rank, Done done);
  ~ClientQueue();
  ClientQueue(const ClientQueue&) = delete;
  ClientQueue& operator=(const ClientQueue&) = delete;

  // Copies `count` elements at `buf` in, publishes the entry; the result is copied back
  // to `buf` before Done. Throws ConfigError on a bad size or while an op is in flight,
  // AbortedError once the queue was poisoned or closed.
  void submit(uint64_t op_id, uint64_t seq, Kind kind, DType dt, ReduceOp op, size_t count,
              void* buf);
  // Stops the completer (joined unless called from it) without reporting the op in flight.
  void close();
  // The memory's descriptor, handed to mccld (shm_map.h); -1 once unlink() let it go.
  int fd() const { return s_->map->fd(); }
  void unlink() { s_->map->unlink(); }
  const std::string& name() const { return s_->map->name(); }
  size_t slot_bytes() const { return s_->slot_bytes; }

 private:
  // Everything the completer touches, shared with it: the queue may be destroyed on the
  // completer itself (the last reference to its owner dropped inside Done), and the
  // thread must still find its state when Done returns.
  struct State {
    size_t slot_bytes;
    int rank;
    Done done;
    std::unique_ptr<SharedMap> map;
    std::shared_ptr<Ticket> submitted, completed;
    std::mutex mu;
    std::condition_variable cv;  // completer: an op was published, or stop
    bool stop = false;
    bool inflight = false;
    uint64_t published = 0;      // ops published so far (the value of `submitted`)
    uint64_t op_id = 0;
    void* buf = nullptr;
    size_t nbytes = 0;
    std::shared_ptr<const Error> daemon_error() const;
    uint64_t completed_before_failure() const;  // from the error record; 0 if none
  };
  static void completer_main(std::shared_ptr<State> s);

  std::shared_ptr<State> s_;
  std::thread thread_;
};

}  // namespace mccl::opqueue
