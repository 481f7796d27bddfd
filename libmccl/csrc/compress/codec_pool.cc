#include "compress/codec_pool.h"

#include "core/thread_name.h"

namespace mccl {

CodecPool::CodecPool(int threads) {
  for (int i = 1; i < threads; ++i) helpers_.emplace_back([this] { helper_main(); });
}

CodecPool::~CodecPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

void CodecPool::run(size_t tasks, const std::function<void(size_t)>& fn) {
  if (tasks == 0) return;
  if (helpers_.empty() || tasks == 1) {
    for (size_t i = 0; i < tasks; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_.store(0);
    done_ = 0;
    error_ = nullptr;
    ++gen_;
  }
  start_cv_.notify_all();
  work(fn, tasks);
  std::exception_ptr err;
  {
    std::unique_lock<std::mutex> lk(mu_);
    // No helper may still be inside work() when this returns: the next run() rewrites fn_.
    done_cv_.wait(lk, [&] { return done_ == tasks_ && busy_ == 0; });
    fn_ = nullptr;
    err = error_;
    error_ = nullptr;
  }
  if (err) std::rethrow_exception(err);
}

// A helper enters with the job it read under mu_ and is counted in busy_ until it leaves, so
// run() cannot return, and no next job can reset next_, while it is in here.
void CodecPool::work(const std::function<void(size_t)>& fn, size_t tasks) {
  for (;;) {
    const size_t i = next_.fetch_add(1);
    if (i >= tasks) return;
    std::exception_ptr err;
    try {
      fn(i);
    } catch (...) {
      err = std::current_exception();
    }
    std::lock_guard<std::mutex> lk(mu_);
    if (err && !error_) error_ = err;
    if (++done_ == tasks) done_cv_.notify_all();
  }
}

void CodecPool::helper_main() {
  name_this_thread("mccl-codec");
  unsigned long long seen = 0;
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    start_cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
    if (stop_) return;
    seen = gen_;
    if (!fn_) continue;  // that job is over already
    const std::function<void(size_t)>& fn = *fn_;
    const size_t tasks = tasks_;
    ++busy_;
    lk.unlock();
    work(fn, tasks);
    lk.lock();
    if (--busy_ == 0) done_cv_.notify_all();
  }
}

}  // namespace mccl
