// Reduce-scatter: the reduce-scatter half of the ring on a scratch copy of the input
// (the caller's send buffer is never written), rotated so rank r ends with block r.
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "reduce.h"

namespace mccl {

void reduce_scatter_ring(Collective& c, const void* send, void* recv, size_t count, DType dt,
                         ReduceOp op) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(dt), block = count * es;
  if (count == 0) return;
  ReduceFn fn = reduce_fn(dt, op);
  if (n == 1) {
    std::memmove(recv, send, block);
    if (op == ReduceOp::kAvg) finalize_avg(recv, count, dt, n);
    return;
  }
  uint8_t* work = c.scratch.get(2, block * n);
  std::memcpy(work, send, block * n);
  // n equal blocks: the balanced layout puts block b at element b * count.
  RingLayout L = RingLayout::balanced(n, count * n, es, auto_segment_bytes(c.opts, block));
  RingPhases ph;
  ph.all_gather = false;
  ph.shift = -1;  // rank r ends owning block r
  ph.fn = fn;
  ring_pipeline(c, work, L, ph);
  std::memcpy(recv, work + size_t(r) * block, block);
  if (op == ReduceOp::kAvg) finalize_avg(recv, count, dt, n);
}

}  // namespace mccl
