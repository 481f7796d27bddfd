// The pipelined ring shared by all-reduce, reduce-scatter and all-gather.
//
// The buffer is cut into N chunks (one per rank) and every chunk into S segments.
// Reduce-scatter runs N-1 steps: at step s a rank sends chunk (r - s + shift) to its
// right neighbour and reduces chunk (r - s - 1 + shift) arriving from its left; after
// it, rank r owns the fully reduced chunk (r + 1 + shift). All-gather then runs N-1
// steps forwarding owned chunks around the ring, receiving straight into place.
//
// It runs as a dataflow, segment by segment: the moment segment j of step s arrives it
// is reduced and sent on as segment j of step s+1, so all links and the reduction work
// at once instead of in lock-step rounds. Receives are posted for every step up front:
// reduce-scatter receives reduce what arrives straight into the buffer (reduce-receives,
// done by the thread that reads the socket), all-gather receives land directly in the
// final buffer (data can only arrive there after this rank is done with that region: it
// has to go round the ring).
//
// Pieced (RingLayout::pieced, for ops with tickets: pieces.h): segment j of every chunk is
// a part of piece j, a consecutive range of the buffer, so each piece goes round the ring
// on its own and finishes on its own. A piece is started (its reduce-receives posted and
// its first send made) only once the gate says its input is ready; frames for it that
// arrive earlier wait in the transport. Once this rank holds the piece's final bits and
// no send reads it any more, the gate is told.
//
// Reduce-scatter alone can also run out of place (RingPhases::result): the caller's buffer
// is then only read, partial sums travel through the scratch slots (a slot is reused once
// the send of its sum has completed) and the last step lands in `result` directly, so the
// input is never copied.
#pragma once
#include <cstddef>
#include <vector>

#include "algorithms/collective.h"
#include "algorithms/pieces.h"
#include "reduce/reduce.h"

namespace mccl {

struct RingLayout {
  int n = 1;                // ranks
  size_t elem = 1;          // bytes per element
  size_t count = 0;         // elements in the whole buffer
  size_t segs = 1;          // segments per chunk
  std::vector<size_t> off;  // balanced: chunk c starts at element off[c]
  std::vector<size_t> len;  // and holds len[c] elements
  const Pieces* pieces = nullptr;  // pieced: segment j of chunk c is part c of piece j

  // Balanced chunks of `count` elements; segments of about `seg_bytes`.
  static RingLayout balanced(int n, size_t count, size_t elem, size_t seg_bytes);
  // One segment per piece of `p` (which must outlive the layout).
  static RingLayout pieced(int n, const Pieces& p);
  size_t max_chunk() const;
  // Segment j of chunk c: its first element in the buffer, and its length.
  size_t seg_off(int c, size_t j) const {
    return pieces ? pieces->begin(j) + part_begin(pieces->len(j), n, c)
                  : off[c] + part_begin(len[c], segs, j);
  }
  size_t seg_len(int c, size_t j) const {
    return pieces ? part_len(pieces->len(j), n, c) : part_len(len[c], segs, j);
  }
  size_t max_seg() const;  // elements of the longest segment
};

struct RingPhases {
  bool reduce_scatter = true;
  bool all_gather = true;
  int shift = 0;
  ReduceFn fn = nullptr;  // needed for reduce_scatter
  // Reduce-scatter without all-gather only: when set, `buf` is read, never written, and
  // the rank's fully reduced chunk is written here (its len[] elements).
  uint8_t* result = nullptr;
  // Pieced layouts only (in place, both phases): when each piece may start and is done.
  PieceGate* gate = nullptr;
};

void ring_pipeline(Collective& c, uint8_t* buf, const RingLayout& layout, const RingPhases& ph);

}  // namespace mccl
