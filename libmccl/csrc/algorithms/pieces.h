// A ticketed op's buffer as consecutive pieces, and the gate between the pieces and
// the op's tickets (ticket.h): a piece is read only once `ready` covers it, and `done`
// is raised over every finished prefix of pieces.
//
// The cut is a function of (count, element size, pipeline_bytes, world size) only, so
// every rank cuts alike; the number of pieces goes into the op's signature, so ranks
// that disagree (one pipelined, one not, or other pipeline sizes) fail with
// CollectiveMismatch instead of exchanging messages of different sizes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "algorithms/collective.h"
#include "core/ticket.h"

namespace mccl {

struct Pieces {
  size_t count = 0;        // elements of the whole buffer
  size_t elem = 1;         // bytes per element
  size_t piece_elems = 1;  // elements per piece (the last one may be shorter)
  size_t n = 0;            // pieces
  bool balanced = false;   // nearly equal parts (part_begin) instead of piece_elems each

  // Pieces of at least `pipeline_bytes`, grown with the buffer and the ring (pieces.cc),
  // each at least one element per rank.
  static Pieces cut(size_t count, size_t elem, size_t pipeline_bytes, int ranks);
  // `parts` nearly equal pieces, as part_begin/part_len split a buffer (collective.h): the
  // groups of the compressed all-reduce (compressed.cc), which read only their own range.
  static Pieces split(size_t count, size_t elem, size_t parts);
  size_t begin(size_t j) const { return balanced ? part_begin(count, n, j) : j * piece_elems; }
  size_t end(size_t j) const {
    return j + 1 < n ? (balanced ? part_begin(count, n, j + 1) : (j + 1) * piece_elems) : count;
  }
  size_t len(size_t j) const { return end(j) - begin(j); }
};

class PieceGate {
 public:
  PieceGate(Collective& c, const OpTickets& t, const Pieces& p, const char* op);

  // True once piece j's input may be read; AbortedError if the producer poisoned `ready`.
  bool ready(size_t j) const;
  // CollectiveTimeout ("Timed out ...") once the op's deadline passed with piece j not ready.
  void check_deadline(size_t j) const;
  // Blocks until piece j is ready, in slices that keep driving the transport, so an abort,
  // a lost peer or the op's deadline end the wait.
  void wait_ready(size_t j);
  // For a loop that starts pieces as their input arrives: the next finished request while
  // piece j is still awaited with `outstanding` requests in flight, or nullptr when the
  // caller should look at the pieces again. With nothing in flight it sleeps on the ready
  // ticket (its producer wakes it), not in poll slices; else it waits on the links for up to
  // a poll slice and checks the op's deadline.
  RequestPtr next_or_ready(size_t j, size_t outstanding);
  // Piece j's result is final and the engine no longer reads it: `finalize` runs on it,
  // then `done` covers every piece whose predecessors finished too.
  void finished(size_t j);

  // Optional per-piece last step (AVG's division), run before the piece is announced.
  std::function<void(size_t begin_elem, size_t elems)> finalize;

 private:
  uint64_t target(size_t j) const { return t_.base + uint64_t(p_.end(j)) * p_.elem; }

  Collective& c_;
  const OpTickets& t_;
  const Pieces& p_;
  const char* op_;
  std::vector<bool> finished_;
  size_t next_done_ = 0;  // pieces [0, next_done_) are announced
};

}  // namespace mccl
