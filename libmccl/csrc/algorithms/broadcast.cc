// Broadcast: direct fan-out from the root (one step, (N-1) copies out of the root), and a
// pipelined chain root -> root+1 -> ... where each rank forwards a segment the moment
// it has landed, so the time is ~ size/bandwidth + (N-2) segments, not N-1 full copies
// out of the root's link.
#include <algorithm>
#include <string>

#include "algorithms/algorithms.h"
#include "core/errors.h"

namespace mccl {

void broadcast_fanout(Collective& c, void* buf, size_t nbytes, int root) {
  const int n = c.size(), r = c.rank();
  if (nbytes == 0 || n == 1) return;
  uint8_t* p = static_cast<uint8_t*>(buf);
  if (r == root) {
    for (int q = 0; q < n; ++q) {
      if (q != root) c.send(q, p, nbytes, 0);
    }
    c.wait_all(n - 1);
  } else {
    c.recv(root, p, nbytes, 0);
    c.wait_all(1);
  }
}

void broadcast(Collective& c, void* buf, size_t nbytes, int root) {
  // Direct fan-out puts (N-1) copies on the root's link: the same link-byte bound as the
  // one-round all-reduce. With two ranks the chain is the fan-out.
  if (nbytes * size_t(c.size() - 1) <= c.opts.small_allreduce_bytes || c.size() == 2) {
    broadcast_fanout(c, buf, nbytes, root);
  } else {
    broadcast_chain(c, buf, nbytes, root);
  }
}

void broadcast_chain(Collective& c, void* buf, size_t nbytes, int root) {
  const int n = c.size(), r = c.rank();
  if (nbytes == 0 || n == 1) return;
  if (n == 2) return broadcast_fanout(c, buf, nbytes, root);
  uint8_t* p = static_cast<uint8_t*>(buf);
  const int pos = ring_mod(r - root, n);  // place in the chain
  const int next = pos + 1 < n ? ring_mod(r + 1, n) : -1;
  const int prev = ring_mod(r - 1, n);
  // The last rank's copy ends N-2 segments after the root's last byte leaves: keep that
  // fill near 1/32 of the transfer (a segment of nbytes/8 cost 75 % at N=8), within
  // segments large enough that per-message costs stay small.
  size_t seg = c.opts.segment_bytes
                   ? c.opts.segment_bytes
                   : std::clamp<size_t>(nbytes / (32 * size_t(n - 2)), 128 << 10, 4 << 20);
  const size_t segs = (nbytes + seg - 1) / seg;
  auto at = [&](size_t j) { return p + part_begin(nbytes, segs, j); };
  auto len = [&](size_t j) { return part_len(nbytes, segs, j); };
  c.t.set_tag_namer([segs](uint32_t t) {
    return "chain segment " + std::to_string(t + 1) + " of " + std::to_string(segs);
  });
  size_t outstanding = 0;
  if (pos == 0) {
    for (size_t j = 0; j < segs; ++j, ++outstanding) c.send(next, at(j), len(j), uint32_t(j));
  } else {
    for (size_t j = 0; j < segs; ++j, ++outstanding) c.recv(prev, at(j), len(j), uint32_t(j), j);
  }
  while (outstanding > 0) {
    RequestPtr req = c.next();
    --outstanding;
    if (!req->is_send && next >= 0) {
      size_t j = req->cookie;
      c.send(next, at(j), len(j), uint32_t(j));
      ++outstanding;
    }
  }
}

void broadcast(Collective& c, Algo a, void* buf, size_t nbytes, int root) {
  switch (a) {
    case Algo::kFanout: return broadcast_fanout(c, buf, nbytes, root);
    case Algo::kChain: return broadcast_chain(c, buf, nbytes, root);
    case Algo::kBinomial: return broadcast_binomial(c, buf, nbytes, root);
    case Algo::kScatterAllgather: return broadcast_scatter_allgather(c, buf, nbytes, root);
    default:
      throw_error(ErrorKind::kGeneric, std::string("[broadcast] internal error: no algorithm ") +
                                           algo_name(a));
  }
}

}  // namespace mccl
