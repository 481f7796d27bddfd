// The collective algorithms. Each is a small unit over a Collective (transport +
// deadline + scratch) and, where it reduces, a Reduction (reduce.h: combine, then finish
// once). Sizes are bytes unless named `count` (elements). Every rank of the communicator calls the same function with
// the same sizes; the transport checks that (frame signatures).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/collective.h"
#include "algorithms/pieces.h"
#include "core/dtype.h"
#include "reduce/reduce.h"

namespace mccl {

void allreduce(Collective& c, void* buf, size_t count, const Reduction& red);
// With tickets (either may be null): the ring runs piece by piece as `ready` allows and
// raises `done` as pieces finish; a one-round op waits for all of its input first.
void allreduce(Collective& c, void* buf, size_t count, const Reduction& red, const OpTickets& t);
// The pieces a ticketed all-reduce is pipelined in; n == 0 when it is not (one round,
// one rank, nothing to reduce). Identical on every rank given the same arguments.
Pieces allreduce_pieces(const Options& opts, int size, size_t count, DType dt);
void allreduce_ring(Collective& c, void* buf, size_t count, const Reduction& red);
void allreduce_small(Collective& c, void* buf, size_t count, const Reduction& red);

// Ranks grouped by switch (Options::switch_of_rank), as hierarchical.cc runs over them.
// Built from the same vector on every rank, so every rank derives the same groups.
struct Hierarchy {
  std::vector<std::vector<int>> groups;  // global ranks of each switch, switches by id, ascending
  std::vector<std::vector<int>> cores;   // the first `width` ranks of each switch
  std::vector<std::vector<int>> slices;  // slices[i]: core rank i of every switch
  std::vector<int> ring_order;           // every rank, switch by switch (allreduce_switch_ring)
  int width = 0;                         // ranks of the smallest switch
  int max_group = 0;                     // ranks of the largest switch
  int group = -1, index = -1;            // this rank's switch and place in it
  int32_t fingerprint = -1;              // of the grouping, for op signatures (>= 0 if active)
  static Hierarchy of(const std::vector<int>& switch_of_rank, int rank);
  bool active() const { return groups.size() >= 2; }
  // The ranks this rank exchanges frames with in allreduce_hierarchical, sorted: its ring
  // neighbours on its switch and in its slice, and the extra ranks folded onto it (or the one
  // it folds onto). Links on demand add these to partners.h's collective_peers.
  std::vector<int> peers(bool ring = false) const;  // ring: allreduce_switch_ring's
};
// Reduce-scatter within each switch, all-reduce across switches, all-gather within each
// switch (hierarchical.cc). Tickets as allreduce's; bitwise identical on every rank.
void allreduce_hierarchical(Collective& c, void* buf, size_t count, const Reduction& red,
                            const Hierarchy& h, const OpTickets& t);
// The flat all-reduce over the ranks in switch order: each uplink carries one ring edge each
// way however the ranks are numbered (hierarchical.cc).
void allreduce_switch_ring(Collective& c, void* buf, size_t count, const Reduction& red,
                           const Hierarchy& h, const OpTickets& t);

void allgather_ring(Collective& c, const void* send, void* recv, size_t nbytes);
void reduce_scatter_ring(Collective& c, const void* send, void* recv, size_t count, const Reduction& red);
void broadcast(Collective& c, void* buf, size_t nbytes, int root);
void reduce_to_root(Collective& c, void* buf, size_t count, const Reduction& red, int root);
void gather(Collective& c, const void* send, void* recv, size_t nbytes, int root);
void scatter(Collective& c, const void* send, void* recv, size_t nbytes, int root);
void alltoall(Collective& c, const void* send, void* recv, size_t nbytes);
void alltoallv(Collective& c, const void* send, const std::vector<size_t>& send_sizes,
               const std::vector<size_t>& send_offsets, void* recv,
               const std::vector<size_t>& recv_sizes, const std::vector<size_t>& recv_offsets);
void barrier(Collective& c);

}  // namespace mccl
