#include "transport/send_thread.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>


#include "core/errors.h"
#include "core/thread_name.h"
#include "transport/pair.h"

namespace mccl {

SendThread::SendThread(std::function<void()> wake_owner) : wake_owner_(std::move(wake_owner)) {}

SendThread::~SendThread() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    waker_.wake_locked();
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void SendThread::start(std::vector<Pair*> pairs) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    pairs_.insert(pairs_.end(), pairs.begin(), pairs.end());  // after any add_pair
  }
  thread_ = std::thread([this] {
    name_this_thread("mccl-send");
    main();
  });
}

void SendThread::add_pair(Pair* pair) {
  std::lock_guard<std::mutex> lk(mu_);
  pairs_.push_back(pair);
}

void SendThread::notify_locked() {
  kicked_ = true;
  waker_.wake_locked();
  cv_.notify_all();
}

void SendThread::pause() {
  std::unique_lock<std::mutex> lk(mu_);
  ++paused_;
  waker_.wake_locked();
  cv_.wait(lk, [&] { return !busy_; });
}

void SendThread::resume() {
  std::lock_guard<std::mutex> lk(mu_);
  --paused_;
  cv_.notify_all();
}

void SendThread::halt() {
  std::unique_lock<std::mutex> lk(mu_);
  halted_ = true;
  waker_.wake_locked();
  cv_.wait(lk, [&] { return !busy_; });
}

void SendThread::take_sent(std::vector<SentFrame>* out) {
  std::lock_guard<std::mutex> lk(mu_);
  out->swap(sent_);
  sent_.clear();
}

bool SendThread::take_error(Pair** pair, int* err) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!err_pair_) return false;
  *pair = err_pair_;
  *err = err_;
  err_pair_ = nullptr;
  halted_ = true;  // the link is lost: the owner fails the transport, this thread writes no more
  return true;
}

bool SendThread::write_pass(std::unique_lock<std::mutex>& lk) {
  bool wrote = false;
  kicked_ = false;
  poll_.clear();
  // By index: add_pair may grow pairs_ while the lock is let go below.
  for (size_t pi = 0; pi < pairs_.size(); ++pi) {
    Pair* p = pairs_[pi];
    for (size_t i = 0; i < p->num_conns() && !err_pair_; ++i) {
      if (paused_ || halted_ || stop_) return wrote;
      if (!p->conn_open(i) || !p->has_queued(i)) continue;
      Pair::SealJob jobs[Pair::kMaxSealJobs];
      if (const int n = p->claim_seal(i, jobs)) {
        // Sealing is this thread's share of the crypto (the bytes are read here anyway):
        // without the lock, like sendmsg, so the owner can queue more meanwhile.
        busy_ = true;
        lk.unlock();
        bool sealed = true;
        try {
          p->seal(jobs, n);
        } catch (const Error&) {
          sealed = false;  // only when the keys are used up or libcrypto fails
        }
        lk.lock();
        busy_ = false;
        cv_.notify_all();
        if (!sealed) {
          err_pair_ = p;
          err_ = EPROTO;
          wake_owner_();
          return wrote;
        }
        p->commit_seal(jobs, n);
        if (paused_ || halted_ || stop_) return wrote;
      }
      iovec iov[Pair::kMaxIov];
      const int cnt = p->gather_iov(i, iov);
      const int fd = p->conn_fd(i);
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = cnt;
      // The frames stay queued (and their buffers alive: failing them needs halt(),
      // which waits for busy_ to clear) while the lock is released for the copy.
      busy_ = true;
      lk.unlock();
      ssize_t w = ::sendmsg(fd, &msg, nosignal_flag() | MSG_DONTWAIT);
      const int err = errno;
      lk.lock();
      busy_ = false;
      cv_.notify_all();
      if (w > 0) {
        // The owner empties sent_ whenever it wakes, so it needs waking only when sent_
        // goes from empty to not.
        const bool was_empty = sent_.empty();
        p->advance(i, static_cast<size_t>(w), &sent_);
        if (was_empty && !sent_.empty()) wake_owner_();
        wrote = true;
      } else if (w < 0 && err != EINTR && err != EAGAIN && err != EWOULDBLOCK) {
        err_pair_ = p;
        err_ = err;
        wake_owner_();
      } else if (w < 0 && err != EINTR) {
        poll_.push_back({fd, POLLOUT, 0});
      }
    }
  }
  return wrote;
}

void SendThread::main() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (paused_ || halted_ || err_pair_) {
      cv_.wait(lk);
      continue;
    }
    if (write_pass(lk)) continue;
    // Frames queued (on another socket) while this pass was in sendmsg: another pass,
    // or they would wait for the full sockets below to drain.
    if (paused_ || halted_ || stop_ || err_pair_ || kicked_) continue;
    if (poll_.empty()) {
      // Nothing queued anywhere: sleep until a pair queues a frame.
      bool queued = false;
      for (Pair* p : pairs_) {
        for (size_t i = 0; i < p->num_conns(); ++i) queued = queued || (p->conn_open(i) && p->has_queued(i));
      }
      if (!queued) cv_.wait(lk);
      continue;
    }
    // Every socket with frames is full: wait until one drains or we are woken.
    waker_.poll(lk, poll_, &busy_, cv_);
  }
}

}  // namespace mccl
