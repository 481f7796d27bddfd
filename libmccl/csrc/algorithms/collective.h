// What every algorithm gets: the transport of the running collective, its deadline,
// tuning knobs and reusable scratch memory. Algorithms are plain functions over this.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/options.h"
#include "transport/transport.h"

namespace mccl {

// Reused across ops: a fresh multi-megabyte malloc per op would page-fault on every
// call and cost more than the copy it serves.
class Scratch {
 public:
  static constexpr int kSlots = 3;
  uint8_t* get(int slot, size_t bytes);
  void release();  // after a failure
  // Frees the slots above `keep_bytes`: one huge op must not pin its scratch forever.
  void trim(size_t keep_bytes);

 private:
  std::unique_ptr<uint8_t[]> buf_[kSlots];
  size_t cap_[kSlots] = {0, 0, 0};
};

struct Collective {
  Transport& t;
  Deadline deadline;
  double timeout_s;
  const Options& opts;
  Scratch& scratch;

  int rank() const { return t.rank(); }
  int size() const { return t.size(); }
  RequestPtr send(int peer, const void* buf, size_t n, uint32_t tag, uint64_t cookie = 0) {
    return t.isend(peer, buf, n, tag, cookie);
  }
  RequestPtr recv(int peer, void* buf, size_t n, uint32_t tag, uint64_t cookie = 0) {
    return t.irecv(peer, buf, n, tag, cookie);
  }
  // buf = fn(what arrives, buf), elements of `elem` bytes.
  RequestPtr recv_reduce(int peer, void* buf, size_t n, uint32_t tag, ReduceFn fn, size_t elem,
                         uint64_t cookie = 0) {
    return t.irecv_reduce(peer, buf, n, tag, fn, elem, cookie);
  }
  // The next finished request of this op (throws on failure or timeout).
  RequestPtr next() { return t.wait_next(deadline, timeout_s); }
  // Like next(), but null if nothing finished by `until` or the deadline, whichever is first
  // (the caller knows what it waited for and says so).
  RequestPtr next_until(Deadline until) {
    until = std::min(until, deadline);
    while (!t.has_completion()) {
      if (Clock::now() >= until) return nullptr;
      t.progress(until);
    }
    return next();
  }
  void wait_all(size_t count) {
    while (count--) next();
  }
};

// Rank arithmetic on a ring.
inline int ring_mod(long long v, int n) { return static_cast<int>(((v % n) + n) % n); }

// [begin, begin + len) of part `i` when `total` items are split into `parts` nearly
// equal parts (the first total % parts parts get one extra item).
inline size_t part_begin(size_t total, size_t parts, size_t i) {
  return (total / parts) * i + (i < total % parts ? i : total % parts);
}
inline size_t part_len(size_t total, size_t parts, size_t i) {
  return total / parts + (i < total % parts ? 1 : 0);
}

// Pipeline segment size in bytes for a message part of `bytes`.
size_t auto_segment_bytes(const Options& opts, size_t bytes);

inline bool ranges_overlap(const void* a, size_t an, const void* b, size_t bn) {
  auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return an && bn && x < y + bn && y < x + an;
}

}  // namespace mccl
