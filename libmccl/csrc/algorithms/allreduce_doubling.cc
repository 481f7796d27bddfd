// All-reduce by recursive doubling, and Rabenseifner's (reduce-scatter by recursive
// halving, then all-gather by recursive doubling), both folded onto the power-of-two core
// (hypercube.h) when the world is not one.
//
// Recursive doubling: log2 P exchanges of the whole buffer, the latency choice.
// Rabenseifner: 2 log2 P exchanges of shrinking halves, 2(P-1)/P of the buffer on the
// critical path: the ring's bytes in far fewer steps, the mid-size choice.
//
// Both leave the same bits on every rank: in recursive doubling the two partners of a step
// compute op(low rank's value, high rank's value) alike (combine_ordered); in
// Rabenseifner each element is reduced by its one owner and copied everywhere. AVG is SUM
// finished once on the final value, before it spreads.
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/hypercube.h"

namespace mccl {

namespace {

// An extra rank's whole part: hand the input over, take the result back.
void run_as_extra(Collective& c, const Fold& f, uint8_t* buf, size_t nb, uint32_t out_tag) {
  send_wait(c, f.core_of_extra(), buf, nb, 0);
  recv_wait(c, f.core_of_extra(), buf, nb, out_tag);
}

// A core rank takes in the input of the extra rank folded onto it (tag 0).
void fold_in(Collective& c, const Fold& f, uint8_t* buf, size_t count, const Reduction& red) {
  const int x = f.extra_of_core();
  if (x < 0) return;
  uint8_t* theirs = c.scratch.get(2, count * red.elem);
  recv_wait(c, x, theirs, count * red.elem, 0);
  combine_ordered(red, buf, theirs, count, true);  // the core rank is the lower one
}

void fold_out(Collective& c, const Fold& f, const uint8_t* buf, size_t nb, uint32_t tag) {
  const int x = f.extra_of_core();
  if (x >= 0) send_wait(c, x, buf, nb, tag);
}

}  // namespace

void allreduce_recursive_doubling(Collective& c, void* buf, size_t count, const Reduction& red) {
  const int n = c.size();
  if (count == 0 || n == 1) return;
  const Fold f = Fold::of(n, c.rank());
  uint8_t* b = static_cast<uint8_t*>(buf);
  const size_t nb = count * red.elem;
  const uint32_t out_tag = 1 + f.steps;
  name_tags(c, f.steps, "recursive-doubling");
  if (f.extra()) return run_as_extra(c, f, b, nb, out_tag);
  fold_in(c, f, b, count, red);
  uint8_t* theirs = c.scratch.get(2, nb);
  uint32_t tag = 1;
  for (int d = 1; d < f.p; d *= 2, ++tag) {
    const int partner = f.r ^ d;
    c.recv(partner, theirs, nb, tag);
    c.send(partner, b, nb, tag);
    c.wait_all(2);  // our send read `b`: only now may it change
    combine_ordered(red, b, theirs, count, f.r < partner);
  }
  red.finish(b, count, n);
  fold_out(c, f, b, nb, out_tag);
}

void allreduce_rabenseifner(Collective& c, void* buf, size_t count, const Reduction& red) {
  const int n = c.size();
  if (count == 0 || n == 1) return;
  const Fold f = Fold::of(n, c.rank());
  uint8_t* b = static_cast<uint8_t*>(buf);
  const size_t nb = count * red.elem, es = red.elem;
  const uint32_t out_tag = 1 + 2 * f.steps;
  name_tags(c, f.steps, "recursive-halving", "recursive-doubling");
  if (f.extra()) return run_as_extra(c, f, b, nb, out_tag);
  fold_in(c, f, b, count, red);
  const std::vector<size_t> off = even_blocks(count, f.p);
  halving_reduce_scatter(c, f, b, off, red, 1);
  // This rank's block is final here and nowhere else: finish it once, then spread it.
  red.finish(b + off[f.r] * es, off[f.r + 1] - off[f.r], n);
  doubling_allgather(c, f, b, off, es, 1 + f.steps);
  fold_out(c, f, b, nb, out_tag);
}

}  // namespace mccl
