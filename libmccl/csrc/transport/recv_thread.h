// Threads that read bulk payloads off the link sockets, beside the progress thread.
//
// Without them the progress thread reads every byte that arrives, and (through the
// receives' sinks, landing.h: the algorithms' reduce-receives) does the reductions too: at
// 8 hosts x 10 Gbit/s that one thread was each rank's busiest. Now the progress thread
// still parses every frame header and matches it with its receive, but the rest of a
// large payload it *lends* to a receive thread, with the socket: that thread reads the
// payload into place (or hands it to the sink) and hands the socket back. Socket i of
// every peer link goes to thread i % threads, so each of a link's striped sockets is read
// (and its stripe consumed) on a thread of its own. Like the send thread, it touches no request:
//   - finished payloads and read errors are handed back through take_done(), and the
//     owner is woken; the owner completes the frame (or turns the error into the pair's
//     PeerLost failure) and resumes parsing that socket;
//   - until then the owner neither polls nor reads that socket;
//   - halt() keeps it off the sockets and destinations for good (the transport failed or
//     closes), so the owner may fail the requests and free their buffers.
// An idle thread sleeps on its condition variable; one with sockets waits in poll(), with
// the socket's SO_RCVLOWAT raised so that it wakes once per kWakeBytes that arrive rather
// than once per packet burst (restored before the socket goes back).
#pragma once
#include <poll.h>
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/landing.h"
#include "transport/poll_waker.h"
#include "transport/socket.h"

namespace mccl {

class Pair;

// A lent socket, handed back. err: 0 the payload is complete, kEof the peer closed the
// socket, else the errno of the failed recv().
struct RecvDone {
  static constexpr int kEof = -1;
  Pair* pair;
  size_t conn;
  int err;
};

class RecvThread {
 public:
  // Payload remainders at least this large are lent; below it the hand-over (two
  // thread wake-ups) costs more than reading on the progress thread.
  static constexpr size_t kLendBytes = 128 << 10;

  explicit RecvThread(std::function<void()> wake_owner);
  ~RecvThread();  // halts and joins
  RecvThread(const RecvThread&) = delete;
  RecvThread& operator=(const RecvThread&) = delete;

  // Owner: read the rest of `land`'s payload from socket `fd` (conn `conn` of `pair`).
  // `land` stays this thread's until the socket comes back through take_done().
  void lend(Pair* pair, size_t conn, int fd, Landing* land);
  // Owner: the sockets handed back since the last call.
  void take_done(std::vector<RecvDone>* out);
  // Owner: returns once the thread is out of recv()/poll() and will not touch a lent
  // socket or destination again; lent sockets are dropped (the owner fails them).
  void halt();

 private:
  struct Job {
    Pair* pair;
    size_t conn;
    int fd;
    Landing* land;
    int lowat = 1;  // the socket's SO_RCVLOWAT as this thread set it
  };
  // Wake for at most this many bytes of a lent socket: fewer wake-ups and system calls
  // per byte, and still a few per segment so reads overlap the segment's arrival.
  static constexpr size_t kWakeBytes = 256 << 10;
  static void set_lowat(Job& job, int bytes);
  void main();
  // Reads each job's socket until it would block; finished or failed jobs go to done_.
  // Returns whether any bytes arrived. Runs without mu_ on the jobs taken from jobs_.
  bool read_pass(std::vector<Job>& jobs, std::vector<RecvDone>& finished);

  std::function<void()> wake_owner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> halted_{false};
  bool busy_ = false;  // reading or polling without mu_
  std::vector<Job> jobs_;  // lent, not yet picked up by the thread
  std::vector<RecvDone> done_;
  std::unique_ptr<uint64_t[]> stage_;  // sinks' payloads are read through it (uint64_t: aligned)
  PollWaker waker_{"receive thread"};
  std::thread thread_;
};

}  // namespace mccl
