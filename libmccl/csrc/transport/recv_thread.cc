#include "transport/recv_thread.h"

#include <errno.h>
#include <sys/socket.h>

#include <algorithm>

#include "core/thread_name.h"
#include "transport/pair.h"

namespace mccl {

namespace {

// Sinks' payloads are read through a stage this large: small enough to stay in L2
// between the kernel's copy and the sink (a reduction), large enough for few recv() calls.
constexpr size_t kStageBytes = 256 << 10;
// One socket may not starve the thread's others for longer than this many bytes.
constexpr size_t kReadBudget = 8 << 20;

}  // namespace

RecvThread::RecvThread(std::function<void()> wake_owner)
    : wake_owner_(std::move(wake_owner)), stage_(new uint64_t[kStageBytes / sizeof(uint64_t)]) {
  thread_ = std::thread([this] {
    name_this_thread("mccl-recv");
    main();
  });
}

RecvThread::~RecvThread() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    halted_ = true;
    waker_.wake_locked();
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void RecvThread::lend(Pair* pair, size_t conn, int fd, Landing* land) {
  std::lock_guard<std::mutex> lk(mu_);
  jobs_.push_back({pair, conn, fd, land});
  waker_.wake_locked();
  cv_.notify_all();
}

void RecvThread::take_done(std::vector<RecvDone>* out) {
  std::lock_guard<std::mutex> lk(mu_);
  out->swap(done_);
  done_.clear();
}

void RecvThread::halt() {
  std::unique_lock<std::mutex> lk(mu_);
  halted_ = true;
  jobs_.clear();
  done_.clear();
  waker_.wake_locked();
  cv_.notify_all();
  cv_.wait(lk, [&] { return !busy_; });
}

bool RecvThread::read_pass(std::vector<Job>& jobs, std::vector<RecvDone>& finished) {
  uint8_t* stage = reinterpret_cast<uint8_t*>(stage_.get());
  bool more = false;
  for (size_t i = 0; i < jobs.size();) {
    Job& job = jobs[i];
    size_t budget = kReadBudget;
    int outcome = 1;  // 1: keep the job (would block, or over budget)
    while (!halted_.load(std::memory_order_relaxed)) {
      const size_t asked = job.land->next_read(kStageBytes);
      ssize_t r = job.land->recv_from(job.fd, MSG_DONTWAIT, stage, kStageBytes);
      if (r > 0) {
        job.pair->touch_read();
        if (job.land->left() == 0) {
          outcome = 0;
          break;
        }
        // A short read drained the socket: back to poll without a recv() for EAGAIN.
        if (static_cast<size_t>(r) < asked) break;
        if (static_cast<size_t>(r) >= budget) {
          more = true;
          break;
        }
        budget -= static_cast<size_t>(r);
        continue;
      }
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      outcome = r == 0 ? RecvDone::kEof : errno;
      break;
    }
    if (halted_.load(std::memory_order_relaxed)) return false;
    if (outcome == 1) {
      ++i;
      continue;
    }
    if (outcome != RecvDone::kEof) set_lowat(job, 1);  // the owner parses headers again
    finished.push_back({job.pair, job.conn, outcome});
    jobs[i] = jobs.back();
    jobs.pop_back();
  }
  return more;
}

void RecvThread::set_lowat(Job& job, int bytes) {
  if (job.lowat == bytes) return;
  // Best effort: where it fails the thread merely wakes more often.
  if (::setsockopt(job.fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof(bytes)) == 0) job.lowat = bytes;
}

void RecvThread::main() {
  std::vector<Job> mine;  // lent sockets this thread is reading
  std::vector<RecvDone> finished;
  std::vector<pollfd> fds;
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (halted_) {
      mine.clear();
      cv_.wait(lk);
      continue;
    }
    mine.insert(mine.end(), jobs_.begin(), jobs_.end());
    jobs_.clear();
    if (mine.empty()) {
      cv_.wait(lk);  // idle: no CPU until a socket is lent
      continue;
    }
    busy_ = true;
    lk.unlock();
    const bool more = read_pass(mine, finished);
    lk.lock();
    busy_ = false;
    cv_.notify_all();
    if (!finished.empty()) {
      // The owner empties done_ whenever it wakes: wake it when done_ stops being empty.
      if (!halted_ && done_.empty()) wake_owner_();
      if (!halted_) done_.insert(done_.end(), finished.begin(), finished.end());
      finished.clear();
    }
    if (more || halted_ || stop_ || !jobs_.empty() || mine.empty()) continue;
    // Every lent socket is drained: wait for data, or for another socket to be lent.
    fds.clear();
    for (Job& j : mine) {
      set_lowat(j, static_cast<int>(j.land->wake_bytes(kWakeBytes)));
      fds.push_back({j.fd, POLLIN, 0});
    }
    waker_.poll(lk, fds, &busy_, cv_);
  }
}

}  // namespace mccl
