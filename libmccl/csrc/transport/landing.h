// Where one frame's payload goes while it is read off a socket: copied into place, or
// combined into place with a reduction (a reduce-receive). The ring's reduce-scatter
// uses the latter: what arrives from the left is added into the buffer while it is still
// hot in cache, instead of landing in scratch memory that the algorithm then reads back,
// and the thread that reads the socket does that share of the reduction.
//
// recv() returns arbitrary byte counts, so an element can be split between two reads;
// the reduction only ever sees whole elements, and the bytes of a split one wait in a
// small carry until the rest arrives.
//
// With per-frame MACs on, every payload byte is fed to the frame's MAC as it is read,
// before any reduction, so the tag is checked over what the peer sent.
#pragma once
#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "integrity/mac.h"
#include "reduce/reduce.h"

namespace mccl {

class Landing {
 public:
  // n payload bytes go to dst; fn null copies, else dst = fn(payload, dst) per element
  // of `elem` bytes (n and dst's position must then be whole elements).
  void start(uint8_t* dst, size_t n, ReduceFn fn = nullptr, size_t elem = 1);
  size_t left() const { return left_; }
  bool reduces() const { return fn_ != nullptr; }
  // Every byte taken from now on is fed to `mac` too (null: none); start() keeps it.
  void authenticate(Poly1305* mac) { mac_ = mac; }

  // Takes n <= left() payload bytes from src (any alignment).
  void put(const uint8_t* src, size_t n);
  // One recv(fd, flags) of at most left() bytes: a copy reads straight into place, a
  // reduction reads into `stage` (cap bytes) and folds it in. Returns what recv()
  // returned (payload bytes taken, 0 at EOF, -1 with errno set).
  ssize_t recv_from(int fd, int flags, uint8_t* stage, size_t cap);
  // The most bytes the next recv_from(..., cap) asks for: a shorter read drained the socket.
  size_t next_read(size_t cap) const { return fn_ ? std::min(left_, cap - carry_n_) : left_; }

 private:
  uint8_t* dst_ = nullptr;  // copy: the next byte; reduce: the next whole element
  size_t left_ = 0;         // payload bytes not yet taken
  ReduceFn fn_ = nullptr;
  size_t elem_ = 1;
  alignas(16) uint8_t carry_[16];  // the first bytes of a split element
  size_t carry_n_ = 0;
  Poly1305* mac_ = nullptr;
};

}  // namespace mccl
