#include "transport/poll_waker.h"

#include <unistd.h>

namespace mccl {

PollWaker::PollWaker(const char* who) { make_wake_pipe(&read_, &write_, who); }

void PollWaker::wake_locked() {
  if (!in_poll_) return;
  char b = 1;
  ssize_t rc = ::write(write_.get(), &b, 1);
  (void)rc;  // a full pipe already wakes the poll
}

void PollWaker::poll(std::unique_lock<std::mutex>& lk, std::vector<pollfd>& fds, bool* busy,
                     std::condition_variable& cv) {
  fds.push_back({read_.get(), POLLIN, 0});
  *busy = true;
  in_poll_ = true;
  lk.unlock();
  ::poll(fds.data(), fds.size(), 1000);
  char buf[64];
  while (::read(read_.get(), buf, sizeof(buf)) > 0) {
  }
  lk.lock();
  in_poll_ = false;
  *busy = false;
  cv.notify_all();
}

}  // namespace mccl
