// Error feedback: what a codec could not carry of one buffer's contribution (and, on the rank
// that owns a part of the result, of that part's reduced value), added to the same buffer's
// next compressed op, so that over steps nothing is lost (the mean of K compressed
// all-reduces of one tensor converges to the exact one).
//
// Kept per communicator, keyed by the buffer (address, elements, dtype, reduce op): DDP
// reduces each gradient bucket from one persistent buffer, so an unchanged script gets
// feedback with no hook. A bucket rebuild allocates new buffers; an entry whose memory
// overlaps a new key is dropped with it, so a rebuilt (resized) bucket starts from zero.
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

  // The residual of this buffer: `elems` floats, zeros when new.
  float* get(const void* buf, size_t count, DType dt, ReduceOp op, size_t elems);
  size_t entries() const { return entries_.size(); }
  size_t bytes() const;
  void clear() { entries_.clear(); }

 private:
  struct Entry {
    uintptr_t addr;
    size_t nbytes;
    size_t count;
    DType dtype;
    ReduceOp op;
    std::vector<float> residual;
  };
  std::list<Entry> entries_;  // most recently used first
};

}  // namespace mccl
