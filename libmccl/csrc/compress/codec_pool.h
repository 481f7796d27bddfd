// Helper threads for the codec work of one compressed op (MCCL_COMPRESSION_THREADS): the
// worker thread splits an encode or decode into parts and runs them here and on itself, then
// goes on with the op. Fork-join only: the helpers touch no transport, and every part is run
// by the time run() returns, so the op's buffers are never written after it (nor after a
// failure). Which thread runs a part changes no bit: a part's elements are computed as the
// whole encode or decode computes them (compress/codec.h, encode_part).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mccl {

class CodecPool {
 public:
  // `threads` in all, this (the calling) thread included: threads - 1 helpers.
  explicit CodecPool(int threads);
  ~CodecPool();
  CodecPool(const CodecPool&) = delete;
  CodecPool& operator=(const CodecPool&) = delete;

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }
  // fn(0) .. fn(tasks - 1), on this thread and the helpers; returns once every one has run,
  // then rethrows the first exception one threw. Called by one thread at a time.
  void run(size_t tasks, const std::function<void(size_t)>& fn);

 private:
  void helper_main();
  void work(const std::function<void(size_t)>& fn, size_t tasks);

  std::mutex mu_;
  std::condition_variable start_cv_;  // helpers: a job (gen_ moved) or stop_
  std::condition_variable done_cv_;   // run(): done_ == tasks_ and no helper busy
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t tasks_ = 0;
  std::atomic<size_t> next_{0};
  size_t done_ = 0;
  int busy_ = 0;  // helpers inside work()
  unsigned long long gen_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> helpers_;
};

}  // namespace mccl
