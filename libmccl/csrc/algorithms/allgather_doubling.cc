// All-gather by recursive doubling, and reduce-scatter by recursive halving, folded onto
// the power-of-two core (hypercube.h): log2 P (+2) steps instead of the ring's N-1.
//
// Folded, core rank i stands for global blocks i and i+P. The core works on a copy with
// those two blocks side by side (block j of the core at `super_blocks`), so each hypercube
// step moves one contiguous range; the copy is laid out back at the end.
#include <cstring>

#include "algorithms/algorithms.h"
#include "algorithms/hypercube.h"

namespace mccl {

namespace {

// Where core block j starts in the side-by-side layout, in units of one rank's block,
// for j in 0..P: core rank j's own block, then its extra's.
std::vector<size_t> super_blocks(const Fold& f, size_t block) {
  std::vector<size_t> off(f.p + 1);
  const int extras = f.n - f.p;
  for (int j = 0; j <= f.p; ++j) off[j] = block * size_t(j + std::min(j, extras));
  return off;
}

}  // namespace

void allgather_doubling(Collective& c, const void* send, void* recv, size_t nbytes) {
  const int n = c.size(), r = c.rank();
  if (nbytes == 0) return;
  uint8_t* out = static_cast<uint8_t*>(recv);
  const uint8_t* in = static_cast<const uint8_t*>(send);
  if (in != out + size_t(r) * nbytes && ranges_overlap(in, nbytes, out, nbytes * n)) {
    uint8_t* copy = c.scratch.get(2, nbytes);  // it would be overwritten in flight
    std::memcpy(copy, in, nbytes);
    in = copy;
  }
  if (n == 1) {
    if (in != out) std::memcpy(out, in, nbytes);
    return;
  }
  const Fold f = Fold::of(n, r);
  const uint32_t out_tag = 1 + f.steps;
  const size_t total = nbytes * n;
  name_tags(c, f.steps, "recursive-doubling");
  if (f.extra()) {
    send_wait(c, f.core_of_extra(), in, nbytes, 0);
    recv_wait(c, f.core_of_extra(), out, total, out_tag);
    return;
  }
  const std::vector<size_t> off = super_blocks(f, nbytes);
  uint8_t* work = f.n == f.p ? out : c.scratch.get(1, total);
  if (work + off[f.r] != in) std::memcpy(work + off[f.r], in, nbytes);
  if (f.extra_of_core() >= 0) recv_wait(c, f.extra_of_core(), work + off[f.r] + nbytes, nbytes, 0);
  doubling_allgather(c, f, work, off, 1, 1);
  if (work != out) {
    for (int j = 0; j < f.p; ++j) {
      std::memcpy(out + size_t(j) * nbytes, work + off[j], nbytes);
      if (j + f.p < n) std::memcpy(out + size_t(j + f.p) * nbytes, work + off[j] + nbytes, nbytes);
    }
  }
  if (f.extra_of_core() >= 0) send_wait(c, f.extra_of_core(), out, total, out_tag);
}

void reduce_scatter_halving(Collective& c, const void* send, void* recv, size_t count,
                            const Reduction& red) {
  const int n = c.size(), r = c.rank();
  const size_t es = red.elem, block = count * es, total = block * n;
  if (count == 0) return;
  const uint8_t* in = static_cast<const uint8_t*>(send);
  if (n == 1) {
    std::memmove(recv, send, block);
    red.finish(recv, count, n);
    return;
  }
  const Fold f = Fold::of(n, r);
  const uint32_t out_tag = 1 + f.steps;
  name_tags(c, f.steps, "recursive-halving");
  if (f.extra()) {
    send_wait(c, f.core_of_extra(), in, total, 0);
    recv_wait(c, f.core_of_extra(), recv, block, out_tag);
    return;
  }
  // The input is only read: the core reduces in a copy laid out side by side.
  const std::vector<size_t> off = super_blocks(f, count);  // elements
  uint8_t* work = c.scratch.get(1, total);
  for (int j = 0; j < f.p; ++j) {
    std::memcpy(work + off[j] * es, in + size_t(j) * block, block);
    if (j + f.p < n) std::memcpy(work + (off[j] + count) * es, in + size_t(j + f.p) * block, block);
  }
  const int x = f.extra_of_core();
  if (x >= 0) {
    uint8_t* theirs = c.scratch.get(2, total);
    recv_wait(c, x, theirs, total, 0);
    for (int j = 0; j < n; ++j) {
      const size_t at = j < f.p ? off[j] : off[j - f.p] + count;
      red.fn(theirs + size_t(j) * block, work + at * es, count);
    }
  }
  halving_reduce_scatter(c, f, work, off, red, 1);
  std::memcpy(recv, work + off[f.r] * es, block);
  red.finish(recv, count, n);
  if (x >= 0) {
    uint8_t* theirs = work + (off[f.r] + count) * es;
    red.finish(theirs, count, n);
    send_wait(c, x, theirs, block, out_tag);
  }
}

}  // namespace mccl
