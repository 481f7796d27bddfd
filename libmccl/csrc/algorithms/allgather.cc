// All-gather: the all-gather half of the ring, every rank starting from its own block.
#include <cstring>
#include <string>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "core/errors.h"

namespace mccl {

void allgather_ring(Collective& c, const void* send, void* recv, size_t nbytes) {
  const int n = c.size(), r = c.rank();
  if (nbytes == 0) return;
  uint8_t* out = static_cast<uint8_t*>(recv);
  uint8_t* mine = out + size_t(r) * nbytes;
  if (send != mine) {
    // An input aliasing another block of the output would be overwritten in flight.
    if (ranges_overlap(send, nbytes, out, nbytes * n)) {
      uint8_t* copy = c.scratch.get(2, nbytes);
      std::memcpy(copy, send, nbytes);
      send = copy;
    }
    std::memcpy(mine, send, nbytes);
  }
  if (n == 1) return;
  // n equal blocks: the balanced layout puts block b at b * nbytes.
  RingLayout L = RingLayout::balanced(n, nbytes * n, 1, auto_segment_bytes(c.opts, nbytes));
  RingPhases ph;
  ph.reduce_scatter = false;
  ph.shift = -1;  // rank r starts owning block r
  ring_pipeline(c, out, L, ph);
}

void allgather(Collective& c, Algo a, const void* send, void* recv, size_t nbytes) {
  switch (a) {
    case Algo::kRing: return allgather_ring(c, send, recv, nbytes);
    case Algo::kRecursiveDoubling: return allgather_doubling(c, send, recv, nbytes);
    default:
      throw_error(ErrorKind::kGeneric, std::string("[allgather] internal error: no algorithm ") +
                                           algo_name(a));
  }
}

}  // namespace mccl
