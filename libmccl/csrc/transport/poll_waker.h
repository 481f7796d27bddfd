// The interruptible wait of the engine's helper threads (send_thread.h, recv_thread.h):
// poll() on their sockets plus a pipe that the owner writes to when it has new work or
// wants them off the sockets. Both sides hold the helper's mutex around these calls.
#pragma once
#include <poll.h>

#include <condition_variable>
#include <mutex>
#include <vector>

#include "transport/socket.h"

namespace mccl {

class PollWaker {
 public:
  explicit PollWaker(const char* who);  // e.g. "send thread", for the pipe() error
  // Cuts a poll() in progress short; a no-op when none is.
  void wake_locked();
  // Polls `fds` (the pipe is added at the end) for at most a second with `lk` released,
  // *busy set meanwhile; then notifies `cv` (halt()/pause() wait there for !*busy).
  void poll(std::unique_lock<std::mutex>& lk, std::vector<pollfd>& fds, bool* busy,
            std::condition_variable& cv);

 private:
  bool in_poll_ = false;
  Fd read_, write_;
};

}  // namespace mccl
