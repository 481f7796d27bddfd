// Error feedback: what a codec could not carry of one buffer's contribution (and, on the rank
// that owns a part of the result, of that part's reduced value), added to the same buffer's
// next compressed op, so that over steps nothing is lost (the mean of K compressed
// all-reduces of one tensor converges to the exact one).
//
// Kept per communicator, keyed by the buffer (address, elements, dtype, reduce op): DDP
// reduces each gradient bucket from one persistent buffer, so an unchanged script gets
// feedback with no hook. A bucket rebuild allocates new buffers; an entry whose memory
// overlaps a new key is dropped with it, so a rebuilt (resized) bucket starts from zero; an
// entry not used for two rounds of every buffer's ops (2 x entries + 16 compressed ops: DDP
// reduces each live bucket once a step) belonged to a buffer that is gone, and is dropped too,
// so a freed bucket's residual (4 bytes per element) does not outlive it for long.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <vector>

#include "core/dtype.h"

namespace mccl {

class Residuals {
 public:
  // Entries kept at most; the least recently used goes first.
  static constexpr size_t kMaxEntries = 1024;
  static constexpr uint64_t kStaleSlack = 16;

  // The residual of this buffer: `elems` floats, zeros when new; nullptr (no feedback for
  // this op) when it alone is larger than the cap.
  float* get(const void* buf, size_t count, DType dt, ReduceOp op, size_t elems);
  // At most this many bytes of residuals (0: no cap): making room drops the least recently
  // used entries. mccld keeps them for its jobs: a job must not grow the daemon without bound.
  void set_max_bytes(size_t max_bytes) { max_bytes_ = max_bytes; }
  // Entries dropped, or not made, for the cap (a caller warns once).
  uint64_t capped() const { return capped_; }
  size_t entries() const { return entries_.size(); }
  size_t bytes() const { return bytes_; }
  void clear() {
    entries_.clear();
    bytes_ = 0;
  }

 private:
  struct Entry {
    uintptr_t addr;
    size_t nbytes;
    size_t count;
    DType dtype;
    ReduceOp op;
    std::vector<float> residual;
    uint64_t last = 0;  // clock_ at its last use
  };
  std::list<Entry> entries_;  // most recently used first
  uint64_t clock_ = 0;        // compressed ops so far
  size_t max_bytes_ = 0;      // 0: no cap
  size_t bytes_ = 0;          // of entries_' residuals
  uint64_t capped_ = 0;
};

}  // namespace mccl
