// Segment tickets: a monotonic 64-bit counter over one 8-byte-aligned word, raised by a
// producer as the pieces of a buffer become ready and awaited by a consumer.
//
// The word may live in this process or in a MAP_SHARED segment mapped by another process
// (mccld and its clients), so every access is a plain 64-bit atomic on the address and
// waking uses a process-shared wait (Linux: a non-private futex on the word's low 32
// bits; macOS: __ulock on the same half). A writer that cannot wake anyone (a GPU
// writing the word with a stream memory operation) is still seen: waits sleep in bounded
// slices and re-read the word.
//
// Tickets only grow: signal(v) is an atomic max, so a late or repeated signal is harmless.
// One counter per buffer and purpose; counting cumulative bytes lets one word serve every
// op of a job (an op's targets are `base + bytes`), so it is never reset. poison() sets
// the word to kPoison, which every present and future wait reports instead of success:
// no waiter is left hanging after the producer or the engine failed.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/clock.h"

namespace mccl {

class Ticket {
 public:
  static constexpr uint64_t kPoison = UINT64_MAX;
  enum class Wait { kReached, kTimeout, kPoisoned };

  Ticket();  // owns its word, starting at 0
  // A view of the word at `word` (8-byte aligned; ConfigError otherwise). The caller keeps
  // that memory mapped for as long as this Ticket is used.
  static std::shared_ptr<Ticket> at(void* word);

  uint64_t value() const;
  bool poisoned() const { return value() == kPoison; }
  // Raises the ticket to v (lower values are ignored) and wakes the waiters.
  // kPoison is refused (ConfigError): poison() says what is meant.
  void signal(uint64_t v);
  void poison();
  // Returns once value() >= v (kReached), at the deadline (kTimeout) or once poisoned.
  Wait wait_until(uint64_t v, Deadline deadline) const;
  // The same, re-reading the word at least every `slice`: a word only CPUs write (they
  // wake) may sleep longer than the default slice, so an idle waiter stays idle.
  Wait wait_until(uint64_t v, Deadline deadline, Clock::duration slice) const;
  // wait_until for `timeout_s`, turning the outcomes into typed errors whose message names
  // `what` (e.g. "[engine] all-reduce input"): CollectiveTimeout ("Timed out ...") or
  // AbortedError.
  void wait_or_throw(uint64_t v, double timeout_s, const std::string& what) const;
  // The error of a wait for v that ended with `w` after up to timeout_s (none if kReached).
  void raise_unless_reached(Wait w, uint64_t v, double timeout_s, const std::string& what) const;
  uintptr_t address() const { return reinterpret_cast<uintptr_t>(word_); }

 private:
  explicit Ticket(uint64_t* word) : word_(word) {}
  void wake_all() const;
  void sleep_while(uint32_t low, Deadline until, Clock::duration slice) const;

  std::unique_ptr<uint64_t> own_;  // null for a view
  uint64_t* word_;
};

// Wakes the waiters of the ticket word at `word` after something that cannot wake them
// wrote it (a GPU stream write): a C entry point for a device's host callback, e.g.
// cuLaunchHostFunc(stream, mccl_ticket_wake, word). Touches only the word.
extern "C" void mccl_ticket_wake(void* word);

// The tickets of one op. The engine waits for ready >= base + end of a piece before it
// touches the piece and raises done to base + end once the piece's result is final and
// the engine no longer reads it. Either may be null.
struct OpTickets {
  std::shared_ptr<Ticket> ready, done;
  uint64_t base = 0;
  bool any() const { return ready || done; }
};

}  // namespace mccl
