// Reduce-scatter: the reduce-scatter half of the ring, out of place (the caller's send
// buffer is never written), rotated so rank r ends with block r.
#include <cstring>
#include <string>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "core/errors.h"
#include "reduce/reduce.h"

namespace mccl {

void reduce_scatter_ring(Collective& c, const void* send, void* recv, size_t count, const Reduction& red) {
  const int n = c.size();
  const size_t es = red.elem, block = count * es;
  if (count == 0) return;
  if (n == 1) {
    std::memmove(recv, send, block);
    red.finish(recv, count, n);
    return;
  }
  // n equal blocks: the balanced layout puts block b at element b * count.
  RingLayout L = RingLayout::balanced(n, count * n, es, auto_segment_bytes(c.opts, block));
  RingPhases ph;
  ph.all_gather = false;
  ph.shift = -1;  // rank r ends owning block r
  ph.fn = red.fn;
  const uint8_t* in = static_cast<const uint8_t*>(send);
  if (ranges_overlap(in, block * n, recv, block)) {
    // The result would overwrite input still to be read (and sent): work on a copy.
    uint8_t* copy = c.scratch.get(2, block * n);
    std::memcpy(copy, in, block * n);
    in = copy;
  }
  // Out of place: the input is only read and block r lands in `recv`, so a large
  // reduce-scatter neither copies its input nor faults in an input-sized scratch buffer.
  ph.result = static_cast<uint8_t*>(recv);
  ring_pipeline(c, const_cast<uint8_t*>(in), L, ph);
  red.finish(recv, count, n);
}

void reduce_scatter(Collective& c, Algo a, const void* send, void* recv, size_t count,
                    const Reduction& red) {
  switch (a) {
    case Algo::kRing: return reduce_scatter_ring(c, send, recv, count, red);
    case Algo::kRecursiveHalving: return reduce_scatter_halving(c, send, recv, count, red);
    default:
      throw_error(ErrorKind::kGeneric,
                  std::string("[reduce_scatter] internal error: no algorithm ") + algo_name(a));
  }
}

}  // namespace mccl
