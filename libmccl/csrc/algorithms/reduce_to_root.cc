// Reduce to a root: a pipelined chain root+1 -> root+2 -> ... -> root. Each rank adds
// its contribution to a segment as it passes and forwards it; partial sums live in
// scratch, so non-root buffers are left unchanged.
#include <algorithm>
#include <string>

#include "algorithms/algorithms.h"
#include "reduce/reduce.h"

namespace mccl {

void reduce_to_root(Collective& c, void* buf, size_t count, const Reduction& red, int root) {
  const int n = c.size(), r = c.rank();
  if (count == 0) return;
  const ReduceFn fn = red.fn;
  const size_t es = red.elem, nbytes = count * es;
  uint8_t* p = static_cast<uint8_t*>(buf);
  if (n > 1) {
    const int pos = ring_mod(r - root - 1, n);  // the root is last
    const int next = pos + 1 < n ? ring_mod(r + 1, n) : -1;
    const int prev = ring_mod(r - 1, n);
    size_t seg = c.opts.segment_bytes ? c.opts.segment_bytes
                                      : std::clamp<size_t>(nbytes / 8, 64 << 10, 4 << 20);
    const size_t segs = std::max<size_t>(1, (count + seg / es - 1) / std::max<size_t>(seg / es, 1));
    auto first = [&](size_t j) { return part_begin(count, segs, j); };
    auto elems = [&](size_t j) { return part_len(count, segs, j); };
    c.t.set_tag_namer([segs](uint32_t t) {
      return "chain segment " + std::to_string(t + 1) + " of " + std::to_string(segs);
    });
    size_t outstanding = 0;
    if (pos == 0) {
      for (size_t j = 0; j < segs; ++j, ++outstanding) {
        c.send(next, p + first(j) * es, elems(j) * es, uint32_t(j));
      }
    } else {
      uint8_t* acc = c.scratch.get(2, nbytes);
      for (size_t j = 0; j < segs; ++j, ++outstanding) {
        c.recv(prev, acc + first(j) * es, elems(j) * es, uint32_t(j), j);
      }
      while (outstanding > 0) {
        RequestPtr req = c.next();
        --outstanding;
        if (req->is_send) continue;
        size_t j = req->cookie;
        uint8_t* a = acc + first(j) * es;
        if (next >= 0) {
          fn(p + first(j) * es, a, elems(j));
          c.send(next, a, elems(j) * es, uint32_t(j));
          ++outstanding;
        } else {
          fn(a, p + first(j) * es, elems(j));
        }
      }
    }
    c.wait_all(outstanding);
  }
  if (r == root) red.finish(buf, count, n);
}

}  // namespace mccl
