// The thread that writes a transport's bulk frames to its sockets, sealing them first
// when the link's frames are sealed (pair.h).
//
// The progress thread would otherwise copy every byte into the kernel itself, between
// its receives and their sinks' work: one core's worth for both directions of every link.
// With this thread, sends run beside them. It only moves bytes from the pairs' send
// queues into sockets; everything that touches requests (completion, failure, error
// messages) stays on the owner (progress) thread:
//   - finished frames are handed back through take_sent(), and the owner is woken;
//   - the first socket error stops the thread's writing and is handed back through
//     take_error(); the owner turns it into the pair's PeerLost failure;
//   - pause()/halt() keep it off the sockets (out of sendmsg and poll) while the owner
//     writes control frames or fails everything itself.
// The pairs' send queues are guarded by mu(); the thread holds it only to pick up and
// retire frames, never across a system call.
#pragma once
#include <poll.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/poll_waker.h"
#include "transport/request.h"
#include "transport/socket.h"

namespace mccl {

class Pair;

struct SentFrame {
  Pair* pair;
  RequestPtr req;  // null for control frames
  size_t length;   // payload bytes
};

class SendThread {
 public:
  explicit SendThread(std::function<void()> wake_owner);
  ~SendThread();  // stops and joins
  SendThread(const SendThread&) = delete;
  SendThread& operator=(const SendThread&) = delete;

  void start(std::vector<Pair*> pairs);
  // A link that came up later (links on demand, linker.h); not with mu() held.
  void add_pair(Pair* pair);
  std::mutex& mu() { return mu_; }
  // New frames were queued; the caller holds mu().
  void notify_locked();
  // Owner thread: returns once the thread is out of sendmsg/poll and will not start
  // another until resume(). halt() is a pause that never ends (the transport failed or
  // closes). Neither may be called with mu() held.
  void pause();
  void resume();
  void halt();
  bool halted() const { return halted_.load(); }

  // Owner thread: frames written since the last call.
  void take_sent(std::vector<SentFrame>* out);
  // Owner thread: the first failed write, if any (its pair and errno); reported once.
  bool take_error(Pair** pair, int* err);

 private:
  void main();
  // One pass over every socket with queued frames; returns whether any bytes went out.
  // Sockets that took nothing are added to poll_ for the wait that follows.
  bool write_pass(std::unique_lock<std::mutex>& lk);

  std::function<void()> wake_owner_;
  std::vector<Pair*> pairs_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> halted_{false};
  int paused_ = 0;
  bool busy_ = false;     // in sendmsg or poll without mu_
  bool kicked_ = false;   // frames were queued since the last pass began
  std::vector<SentFrame> sent_;
  Pair* err_pair_ = nullptr;
  int err_ = 0;
  std::vector<struct pollfd> poll_;
  PollWaker waker_{"send thread"};
  std::thread thread_;
};

}  // namespace mccl
