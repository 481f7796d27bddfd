// All-reduce: the pipelined ring (bandwidth), the one-round exchange (latency, few ranks),
// and the dispatch to them and to the hypercube algorithms (allreduce_doubling.cc). Every
// one gives bitwise-identical results on every rank.
#include <cstring>
#include <string>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "core/errors.h"
#include "reduce/reduce.h"

namespace mccl {

namespace {

// The one-round algorithm puts (N-1) copies of the buffer on every link, the ring
// 2(N-1)/N of one: the threshold bounds those link bytes, so the one-round's latency
// win is not spent on a link-bound transfer (at N=4 on 1 Gbit/s a 64 KiB one-round
// took 1.76 ms, the ring 0.83 ms).
bool one_round(const Options& opts, int size, size_t count, DType dt) {
  return count * dtype_size(dt) * size_t(size - 1) <= opts.small_allreduce_bytes;
}

void allreduce_pieced(Collective& c, uint8_t* buf, const Pieces& p, const Reduction& red,
                      const OpTickets& t) {
  PieceGate gate(c, t, p, "allreduce");
  if (red.finishes()) {
    // Per piece, once no send reads it any more: every rank finishes the same final bits.
    gate.finalize = [&](size_t begin, size_t elems) { red.finish(buf + begin * p.elem, elems, c.size()); };
  }
  RingLayout L = RingLayout::pieced(c.size(), p);
  RingPhases ph;
  ph.fn = red.fn;
  ph.gate = &gate;
  ring_pipeline(c, buf, L, ph);
}

}  // namespace

void allreduce(Collective& c, void* buf, size_t count, const Reduction& red) {
  if (count == 0 || c.size() == 1) return;
  allreduce(c, one_round(c.opts, c.size(), count, red.dtype) ? Algo::kOneRound : Algo::kRing, buf,
            count, red);
}

void allreduce(Collective& c, Algo a, void* buf, size_t count, const Reduction& red) {
  if (count == 0 || c.size() == 1) return;
  switch (a) {
    case Algo::kOneRound: return allreduce_small(c, buf, count, red);
    case Algo::kRecursiveDoubling: return allreduce_recursive_doubling(c, buf, count, red);
    case Algo::kRabenseifner: return allreduce_rabenseifner(c, buf, count, red);
    case Algo::kRing: break;
    default:
      throw_error(ErrorKind::kGeneric, std::string("[allreduce] internal error: no algorithm ") +
                                           algo_name(a));
  }
  // In pieces, a few in flight (ring.cc), as the ticketed path runs: on the 16-core machine
  // at 8 hosts x 10 Gbit/s it took 99.5-100.4 % of the ceiling at 64 MB in five runs, the
  // ring over the whole buffer at once 87.7-97.1 % in seven; at 256 MB both swing between
  // about 70 and 100 % from run to run there (docs/benchmarks.md, 3 Dec).
  const Pieces p = Pieces::cut(count, red.elem, c.opts.pipeline_bytes, c.size());
  if (p.n > 1) {
    allreduce_pieced(c, static_cast<uint8_t*>(buf), p, red, OpTickets{});
  } else {
    allreduce_ring(c, buf, count, red);
  }
}

// The rule for ticketed ops (DDP buckets handed over piece by piece): above one piece
// (MCCL_PIPELINE_BYTES) the ring runs pipelined with the producer, whatever the model
// says: only it can start before all of the input is there, and the producer (mccld's
// client) feeds `ready` only a few pieces ahead of `done`, so an algorithm that waited
// for the whole input would wait for ever. At most one piece has nothing to pipeline: it
// waits for its input and runs the chosen algorithm.
Pieces allreduce_pieces(const Options& opts, int size, size_t count, DType dt) {
  if (count == 0 || size == 1 || count * dtype_size(dt) <= opts.pipeline_bytes) return Pieces{};
  return Pieces::cut(count, dtype_size(dt), opts.pipeline_bytes, size);
}

void allreduce(Collective& c, Algo a, void* buf, size_t count, const Reduction& red,
               const OpTickets& t) {
  const Pieces p = allreduce_pieces(c.opts, c.size(), count, red.dtype);
  if (p.n > 0) {
    allreduce_pieced(c, static_cast<uint8_t*>(buf), p, red, t);
    return;
  }
  // Not worth pipelining: the whole buffer is one piece.
  const Pieces whole = Pieces::cut(count, red.elem, count * red.elem, 1);
  PieceGate gate(c, t, whole, "allreduce");
  if (whole.n == 0) return;
  gate.wait_ready(0);
  allreduce(c, a, buf, count, red);
  gate.finished(0);
}

void allreduce_ring(Collective& c, void* buf, size_t count, const Reduction& red) {
  const size_t es = red.elem;
  const size_t chunk_bytes = (count + c.size() - 1) / c.size() * es;
  RingLayout L = RingLayout::balanced(c.size(), count, es, auto_segment_bytes(c.opts, chunk_bytes));
  RingPhases ph;
  ph.fn = red.fn;
  ring_pipeline(c, static_cast<uint8_t*>(buf), L, ph);
  // Every rank holds the same final bits and finishes them the same way.
  red.finish(buf, count, c.size());
}

// Every rank sends its whole buffer to every peer and folds all contributions in rank
// order 0..N-1, so the result is the same bits everywhere. One network round instead of
// the 2 log N of recursive doubling or 2(N-1) of the ring; the extra bytes do not matter
// below the small-message threshold.
void allreduce_small(Collective& c, void* buf, size_t count, const Reduction& red) {
  const int n = c.size(), r = c.rank();
  const size_t nb = count * red.elem;
  uint8_t* all = c.scratch.get(2, nb * n);
  std::memcpy(all + r * nb, buf, nb);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    c.recv(p, all + p * nb, nb, 0);
    c.send(p, all + r * nb, nb, 0);
  }
  c.wait_all(2 * size_t(n - 1));
  std::memcpy(buf, all, nb);
  for (int p = 1; p < n; ++p) red.fn(all + p * nb, buf, count);
  red.finish(buf, count, n);
}

}  // namespace mccl
