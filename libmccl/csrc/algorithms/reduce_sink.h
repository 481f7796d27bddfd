// The algorithms' reduce-receive: a transport sink (transport/sink.h) that folds what
// arrives into its place with a reduction kernel, inout = op(inout, in), in whole
// elements. The transport calls it straight from the bytes it read (the staging buffer,
// a receive thread's stage, an opened record), so nothing is copied for it; it cuts
// nothing itself: the transport hands it whole elements only, because unit() is the
// element size and every frame the algorithms send starts and ends on an element.
#pragma once
#include <cstddef>
#include <cstdint>

#include "reduce/reduce.h"
#include "transport/sink.h"

namespace mccl {

class ReduceSink final : public Sink {
 public:
  ReduceSink(ReduceFn fn, size_t elem) : fn_(fn), elem_(elem) {}
  size_t unit() const override { return elem_; }
  void consume(const uint8_t* src, uint8_t* dst, size_t n) const override { fn_(src, dst, n / elem_); }

 private:
  ReduceFn fn_;
  size_t elem_;
};

}  // namespace mccl
