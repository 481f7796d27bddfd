#include "algorithms/hypercube.h"

#include <cstring>
#include <string>

namespace mccl {

std::vector<size_t> even_blocks(size_t total, int p) {
  std::vector<size_t> off(p + 1);
  for (int b = 0; b <= p; ++b) off[b] = part_begin(total, p, b);
  return off;
}

void combine_ordered(const Reduction& red, uint8_t* mine, uint8_t* theirs, size_t count,
                     bool i_am_low) {
  if (i_am_low) {
    red.fn(theirs, mine, count);
  } else {
    red.fn(mine, theirs, count);  // theirs = op(theirs, mine): the low operand first
    std::memcpy(mine, theirs, count * red.elem);
  }
}

void name_tags(Collective& c, int steps, const char* a, const char* b) {
  const int phases = b ? 2 : 1;
  const std::string pa = a, pb = b ? b : "";
  c.t.set_tag_namer([=](uint32_t t) {
    const int tag = static_cast<int>(t);
    if (tag == 0) return std::string("fold-in from the extra rank");
    if (tag > phases * steps) return std::string("fold-out to the extra rank");
    const bool first = tag <= steps;
    const int k = first ? tag : tag - steps;
    return (first ? pa : pb) + " step " + std::to_string(k) + " of " + std::to_string(steps);
  });
}

void send_wait(Collective& c, int peer, const void* buf, size_t n, uint32_t tag) {
  if (n == 0) return;
  c.send(peer, buf, n, tag);
  c.wait_all(1);
}

void recv_wait(Collective& c, int peer, void* buf, size_t n, uint32_t tag) {
  if (n == 0) return;
  c.recv(peer, buf, n, tag);
  c.wait_all(1);
}

void halving_reduce_scatter(Collective& c, const Fold& f, uint8_t* work,
                            const std::vector<size_t>& off, const Reduction& red, uint32_t tag0) {
  const int i = f.r;
  const size_t es = red.elem;
  uint32_t tag = tag0;
  // Largest distance first: after the step of distance d this rank holds the aligned
  // group of d blocks around its own, reduced over the 2d-rank subcube it spans.
  for (int d = f.p / 2; d >= 1; d /= 2, ++tag) {
    const int partner = i ^ d;
    const int keep = i & ~(d - 1), give = partner & ~(d - 1);
    const size_t keep_n = off[keep + d] - off[keep], give_n = off[give + d] - off[give];
    size_t waits = 0;
    if (keep_n) {
      c.recv_reduce(partner, work + off[keep] * es, keep_n * es, tag, red.fn, es);
      ++waits;
    }
    if (give_n) {
      c.send(partner, work + off[give] * es, give_n * es, tag);
      ++waits;
    }
    c.wait_all(waits);
  }
}

void doubling_allgather(Collective& c, const Fold& f, uint8_t* work,
                        const std::vector<size_t>& off, size_t unit, uint32_t tag0, int rel) {
  const int i = f.r, v = i ^ rel;
  uint32_t tag = tag0;
  // Smallest distance first: before the step of distance d this rank holds the aligned
  // group of d blocks around its own; the partner holds the neighbouring group.
  for (int d = 1; d < f.p; d *= 2, ++tag) {
    const int partner = i ^ d;
    const int have = v & ~(d - 1), get = (v ^ d) & ~(d - 1);
    const size_t have_n = off[have + d] - off[have], get_n = off[get + d] - off[get];
    size_t waits = 0;
    if (get_n) {
      c.recv(partner, work + off[get] * unit, get_n * unit, tag);
      ++waits;
    }
    if (have_n) {
      c.send(partner, work + off[have] * unit, have_n * unit, tag);
      ++waits;
    }
    c.wait_all(waits);
  }
}

}  // namespace mccl
