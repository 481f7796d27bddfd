// What every algorithm gets: the transport of the running collective, its deadline,
// tuning knobs and reusable scratch memory. Algorithms are plain functions over this.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "algorithms/reduce_sink.h"
#include "core/options.h"
#include "reduce/reduce.h"
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
  // A view onto some of the ranks (sub()): rank(), size() and every peer an algorithm
  // names are positions in `members`, which holds global ranks. Null: all ranks.
  const std::vector<int>* members = nullptr;
  int my_index = -1;
  // Added to every tag, so the phases of one op (hierarchical all-reduce) never match each
  // other's frames between the same two ranks.
  uint32_t tag_base = 0;

  // The same op over `group` (global ranks, this rank among them; it must outlive the
  // view), with tags offset by `tag_offset`. Algorithms run on it unchanged. The view
  // shares the scratch slots: its caller must not hold a slot across a call on it.
  Collective sub(const std::vector<int>& group, uint32_t tag_offset) const {
    Collective v = *this;
    v.members = &group;
    v.tag_base = tag_base + tag_offset;
    v.my_index = -1;
    for (size_t i = 0; i < group.size(); ++i) {
      if (group[i] == t.rank()) v.my_index = static_cast<int>(i);
    }
    return v;
  }
  int rank() const { return members ? my_index : t.rank(); }
  int size() const { return members ? static_cast<int>(members->size()) : t.size(); }
  int global(int peer) const { return members ? (*members)[peer] : peer; }
  RequestPtr send(int peer, const void* buf, size_t n, uint32_t tag, uint64_t cookie = 0) {
    return t.isend(global(peer), buf, n, tag_base + tag, cookie);
  }
  RequestPtr recv(int peer, void* buf, size_t n, uint32_t tag, uint64_t cookie = 0) {
    return t.irecv(global(peer), buf, n, tag_base + tag, cookie);
  }
  // buf = fn(what arrives, buf), elements of `elem` bytes, done by whichever thread reads
  // the socket (reduce_sink.h).
  RequestPtr recv_reduce(int peer, void* buf, size_t n, uint32_t tag, ReduceFn fn, size_t elem,
                         uint64_t cookie = 0) {
    return t.irecv_sink(global(peer), buf, n, tag_base + tag, std::make_shared<const ReduceSink>(fn, elem),
                        cookie);
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
