// Barrier by recursive doubling over the folded core: an extra rank checks in with its
// fold partner, the core ranks exchange one byte with each hypercube partner (after step
// k a rank has heard, indirectly, from 2^(k+1) ranks), then release their extras. 2 log N
// rounds of latency, and only the peers of collective_peers (partners.h): a barrier that
// messaged every rank would link every rank to every other under links on demand.
#include <cstdint>

#include "algorithms/algorithms.h"
#include "algorithms/hypercube.h"

namespace mccl {

void barrier(Collective& c) {
  if (c.size() == 1) return;
  const Fold f = Fold::of(c.size(), c.rank());
  name_tags(c, f.steps, "barrier");
  uint8_t out = 1, in = 0;
  if (f.extra()) {
    send_wait(c, f.core_of_extra(), &out, 1, 0);
    recv_wait(c, f.core_of_extra(), &in, 1, uint32_t(f.steps) + 1);
    return;
  }
  const int extra = f.extra_of_core();
  if (extra >= 0) recv_wait(c, extra, &in, 1, 0);
  for (int k = 0; k < f.steps; ++k) {
    const int partner = f.r ^ (1 << k);
    c.recv(partner, &in, 1, uint32_t(k) + 1);
    c.send(partner, &out, 1, uint32_t(k) + 1);
    c.wait_all(2);
  }
  if (extra >= 0) send_wait(c, extra, &out, 1, uint32_t(f.steps) + 1);
}

}  // namespace mccl
