// Broadcast over the folded power-of-two core (hypercube.h): a binomial tree (log2 P
// steps of the whole buffer, the latency choice) or a binomial scatter followed by an
// all-gather by recursive doubling (2 log2 P steps, about 2 buffers on the critical path
// instead of log2 P: van de Geijn's, the mid-size choice).
//
// The core's root is the root itself, or, for an extra rank as root, its fold partner
// (which it hands the buffer first). Positions in the tree are relative by XOR to the
// core's root, so every edge of it joins hypercube partners.
#include "algorithms/algorithms.h"
#include "algorithms/hypercube.h"

namespace mccl {

namespace {

// The buffer reaches the core's root (tag 0); returns that root.
int fold_root_in(Collective& c, const Fold& f, uint8_t* buf, size_t nbytes, int root) {
  if (root < f.p) return root;
  if (f.r == root) send_wait(c, root - f.p, buf, nbytes, 0);
  if (f.r == root - f.p) recv_wait(c, root, buf, nbytes, 0);
  return root - f.p;
}

// Every extra rank but the root gets the buffer from its fold partner.
void fold_out(Collective& c, const Fold& f, uint8_t* buf, size_t nbytes, int root, uint32_t tag) {
  if (f.extra()) {
    if (f.r != root) recv_wait(c, f.core_of_extra(), buf, nbytes, tag);
  } else if (f.extra_of_core() >= 0 && f.extra_of_core() != root) {
    send_wait(c, f.extra_of_core(), buf, nbytes, tag);
  }
}

}  // namespace

void broadcast_binomial(Collective& c, void* buf, size_t nbytes, int root) {
  const int n = c.size();
  if (nbytes == 0 || n == 1) return;
  const Fold f = Fold::of(n, c.rank());
  uint8_t* b = static_cast<uint8_t*>(buf);
  name_tags(c, f.steps, "binomial-tree");
  const int croot = fold_root_in(c, f, b, nbytes, root);
  if (!f.extra()) {
    const int v = f.r ^ croot;
    size_t sends = 0;
    uint32_t tag = 1;
    // At distance d the ranks at multiples of 2d hold the buffer and pass it to v + d.
    for (int d = f.p / 2; d >= 1; d /= 2, ++tag) {
      if ((v & (2 * d - 1)) == 0) {
        c.send(f.r ^ d, b, nbytes, tag);
        ++sends;
      } else if ((v & (2 * d - 1)) == d) {
        recv_wait(c, f.r ^ d, b, nbytes, tag);
      }
    }
    c.wait_all(sends);
  }
  fold_out(c, f, b, nbytes, root, 1 + f.steps);
}

void broadcast_scatter_allgather(Collective& c, void* buf, size_t nbytes, int root) {
  const int n = c.size();
  if (nbytes == 0 || n == 1) return;
  const Fold f = Fold::of(n, c.rank());
  uint8_t* b = static_cast<uint8_t*>(buf);
  name_tags(c, f.steps, "binomial-scatter", "recursive-doubling");
  const int croot = fold_root_in(c, f, b, nbytes, root);
  if (!f.extra()) {
    const int v = f.r ^ croot;
    const std::vector<size_t> off = even_blocks(nbytes, f.p);  // block k: relative rank k's
    size_t sends = 0;
    uint32_t tag = 1;
    // Binomial scatter: at distance d, v (a multiple of 2d) holds blocks [v, v+2d) and
    // passes [v+d, v+2d) on.
    for (int d = f.p / 2; d >= 1; d /= 2, ++tag) {
      if ((v & (2 * d - 1)) == 0) {
        const size_t len = off[v + 2 * d] - off[v + d];
        if (len) {
          c.send(f.r ^ d, b + off[v + d], len, tag);
          ++sends;
        }
      } else if ((v & (2 * d - 1)) == d) {
        recv_wait(c, f.r ^ d, b + off[v], off[v + d] - off[v], tag);
      }
    }
    c.wait_all(sends);
    doubling_allgather(c, f, b, off, 1, 1 + f.steps, croot);
  }
  fold_out(c, f, b, nbytes, root, 1 + 2 * f.steps);
}

}  // namespace mccl
