#include "core/ticket.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <thread>

#include "core/errors.h"

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__APPLE__)
// libc++ waits on atomics the same way; the symbols are in libSystem since macOS 10.12.
extern "C" int __ulock_wait(uint32_t operation, void* addr, uint64_t value, uint32_t timeout_us);
extern "C" int __ulock_wake(uint32_t operation, void* addr, uint64_t wake_value);
#endif

namespace mccl {

namespace {

// A few microseconds of spinning catch a producer that is about to signal (a piece being
// copied) without the two syscalls of a sleep; longer spins only take the core from the
// producer on a busy host (2000 spins cost the daemon path ~40 % more CPU per GB here).
constexpr int kSpins = 100;
// Longest sleep between two reads of the word: bounds how late a writer that does not
// wake (a GPU stream write) is seen.
constexpr auto kSlice = std::chrono::milliseconds(2);

#if defined(__APPLE__)
constexpr uint32_t kUlCompareAndWaitShared = 3;
constexpr uint32_t kUlfWakeAll = 0x00000100;
#endif

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The half of the word the kernel compares: the low 32 bits, which change with every
// signal of less than 4 GiB (a bigger jump that leaves them equal is caught by the slice).
uint32_t* low_half(uint64_t* word) {
  auto* p = reinterpret_cast<uint32_t*>(word);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return p + 1;
#else
  return p;
#endif
}

}  // namespace

Ticket::Ticket() : own_(new uint64_t(0)), word_(own_.get()) {}

std::shared_ptr<Ticket> Ticket::at(void* word) {
  if (word == nullptr || reinterpret_cast<uintptr_t>(word) % alignof(uint64_t) != 0) {
    throw_error(ErrorKind::kConfig, "[ticket] word address " +
                                        std::to_string(reinterpret_cast<uintptr_t>(word)) +
                                        " is null or not 8-byte aligned; place each ticket on "
                                        "its own aligned 64-bit word");
  }
  return std::shared_ptr<Ticket>(new Ticket(static_cast<uint64_t*>(word)));
}

uint64_t Ticket::value() const { return __atomic_load_n(word_, __ATOMIC_ACQUIRE); }

void Ticket::signal(uint64_t v) {
  if (v == kPoison) {
    throw_error(ErrorKind::kConfig, "[ticket] signal(2^64-1) is the poison value; call poison() "
                                    "to fail the waiters");
  }
  uint64_t cur = value();
  while (cur < v) {
    if (__atomic_compare_exchange_n(word_, &cur, v, true, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
      wake_all();
      return;
    }
  }
}

void Ticket::poison() {
  __atomic_store_n(word_, kPoison, __ATOMIC_RELEASE);
  wake_all();
}

static void wake_word(uint64_t* word) {
#if defined(__linux__)
  // Not FUTEX_PRIVATE_FLAG: the waiter may be another process mapping the same page.
  ::syscall(SYS_futex, low_half(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#elif defined(__APPLE__)
  __ulock_wake(kUlCompareAndWaitShared | kUlfWakeAll, low_half(word), 0);
#else
  (void)word;
#endif
}

void Ticket::wake_all() const { wake_word(word_); }

void Ticket::sleep_while(uint32_t low, Deadline until, Clock::duration slice) const {
  auto left = std::min<Clock::duration>(until - Clock::now(), slice);
  if (left <= Clock::duration::zero()) return;
#if defined(__linux__)
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(ns / 1000000000);
  ts.tv_nsec = static_cast<long>(ns % 1000000000);
  // Returns at once if the half no longer holds `low` (EAGAIN), on a wake, or at ts.
  ::syscall(SYS_futex, low_half(word_), FUTEX_WAIT, low, &ts, nullptr, 0);
#elif defined(__APPLE__)
  auto us = std::chrono::duration_cast<std::chrono::microseconds>(left).count();
  __ulock_wait(kUlCompareAndWaitShared, low_half(word_), low,
               static_cast<uint32_t>(std::max<long long>(us, 1)));
#else
  (void)low;
  std::this_thread::sleep_for(std::min<Clock::duration>(left, std::chrono::microseconds(50)));
#endif
}

Ticket::Wait Ticket::wait_until(uint64_t v, Deadline deadline) const {
  return wait_until(v, deadline, kSlice);
}

Ticket::Wait Ticket::wait_until(uint64_t v, Deadline deadline, Clock::duration slice) const {
  for (int i = 0;; ++i) {
    const uint64_t cur = value();
    if (cur == kPoison) return Wait::kPoisoned;
    if (cur >= v) return Wait::kReached;
    if (i < kSpins) {
      cpu_relax();
      continue;
    }
    if (Clock::now() >= deadline) return Wait::kTimeout;
    sleep_while(static_cast<uint32_t>(cur), deadline, slice);
  }
}

void Ticket::wait_or_throw(uint64_t v, double timeout_s, const std::string& what) const {
  raise_unless_reached(wait_until(v, deadline_after(timeout_s)), v, timeout_s, what);
}

void Ticket::raise_unless_reached(Wait w, uint64_t v, double timeout_s,
                                  const std::string& what) const {
  switch (w) {
    case Wait::kReached:
      return;
    case Wait::kPoisoned:
      throw_error(ErrorKind::kAborted, what + ": its ticket was poisoned (the other side failed or "
                                              "aborted); see that side's error");
    case Wait::kTimeout:
      throw_error(ErrorKind::kTimeout,
                  "Timed out after " + format_seconds(timeout_s) + " s: " + what +
                      " waited for its ticket to reach " + std::to_string(v) + ", it holds " +
                      std::to_string(value()) +
                      "; likely cause: the producer of this buffer is stalled or gone; check it, "
                      "or raise the timeout");
  }
}

}  // namespace mccl

extern "C" void mccl_ticket_wake(void* word) { mccl::wake_word(static_cast<uint64_t*>(word)); }
