// mccld's native server of one job's small-op queues (layout.h), one thread per job.
//
// ORDER. Every collective a client issues carries the job's sequence number (1, 2, ...),
// whichever path it takes; `turn` (a ticket) holds the number of the last one finished on
// this host. The dispatcher serves the fast ops, mccld's Python job worker the rest, and
// each starts op s only once turn >= s - 1 and raises turn to s when it is done: the one
// per-job order, so the engine communicator sees the same op sequence on every host and
// never two collectives of one job at once. The fast ops of a rank are taken in its own
// publish order; all local ranks' next entries must carry the same sequence number and
// arguments, else the job fails with CollectiveMismatch naming both ranks.
//
// Per op: wait for every local rank's entry, check it (each field bounds-checked: the
// queue is the client's memory), reduce the local ranks into the first one's data area,
// run the inter-host op on the engine, write the result into every local rank's area,
// raise their `completed`, raise `turn`.
//
// FAILURE. fail() (from mccld's Job, any thread, never blocks) writes the error into every
// queue and poisons every word the parties wait on: the clients' `completed`, the
// `submitted` words this thread waits on, and `turn`. The thread's own errors go to
// `OnFail` (the Job decides the final verdict and calls fail()); the thread then ends.
// Idle, the thread sleeps on a futex in long slices: no CPU.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "communicator/communicator.h"
#include "core/errors.h"
#include "opqueue/layout.h"
#include "opqueue/shm_map.h"
#include "core/ticket.h"

namespace mccl::opqueue {

struct DispatcherSpec {
  std::string job;                  // for messages
  std::vector<int> local_ranks;     // global ranks on this host; the first leads
  std::vector<std::string> queues;  // their queue segments, same order (names, for messages)
  std::vector<int> queue_fds;       // their descriptors as the clients handed them over
  size_t slot_bytes = 0;            // every queue's data area
  int world = 1;                    // ranks of the job
  int hosts = 1;                    // hosts of the job (the engine's size)
  double timeout_s = 1800;
};

// One served op, for mccld's exporter.
struct OpRecord {
  Kind kind;
  uint64_t nbytes;
  double seconds;
};

class Dispatcher {
 public:
  // from_engine: the inter-host op failed (its error may only echo a peer's abort).
  using OnFail = std::function<void(const Error& e, bool from_engine)>;

  // `engine` may be null (a single-host job); it must outlive the dispatcher.
  Dispatcher(DispatcherSpec spec, Communicator* engine, OnFail on_fail);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  std::shared_ptr<Ticket> turn() const { return turn_; }
  void fail(const Error& e);
  // Stops the thread and waits for it; the mappings go with the object.
  void close();
  std::vector<OpRecord> take_records();

 private:
  struct Queue {
    int rank;
    std::unique_ptr<SharedMap> map;
    std::shared_ptr<Ticket> submitted, completed;
    uint8_t* data() const { return map->base() + kDataOff; }
  };

  void main();
  void wait_entries(uint64_t n);
  Entry read_entry(const Queue& q, uint64_t n) const;
  void check_same(const Entry& lead, const Entry& e, int other) const;
  void wait_turn(uint64_t seq);
  void run(const Entry& e);
  [[noreturn]] void protocol_error(int rank, uint64_t n, const std::string& what) const;
  bool stopping() const { return stop_.load(std::memory_order_acquire); }

  const DispatcherSpec spec_;
  Communicator* const engine_;
  OnFail on_fail_;
  std::vector<Queue> queues_;
  std::shared_ptr<Ticket> turn_;
  uint64_t last_seq_ = 0;  // thread only

  std::atomic<bool> stop_{false};
  std::mutex mu_;          // failed_, records_
  bool failed_ = false;
  std::vector<OpRecord> records_;
  std::thread thread_;
};

}  // namespace mccl::opqueue
