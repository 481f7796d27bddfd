// The collective algorithms. Each is a small unit over a Collective (transport +
// deadline + scratch) and, where it reduces, a Reduction (reduce.h: combine, then finish
// once). Sizes are bytes unless named `count` (elements). Every rank of the communicator calls the same function with
// the same sizes; the transport checks that (frame signatures).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/collective.h"
#include "algorithms/cost_model.h"
#include "algorithms/pieces.h"
#include "compress/codec.h"
#include "core/dtype.h"
#include "reduce/reduce.h"

namespace mccl {

class CodecPool;  // compress/codec_pool.h

// The algorithm `a` (cost_model.h; never kAuto): what the communicator runs once it chose.
void allreduce(Collective& c, Algo a, void* buf, size_t count, const Reduction& red);
// With tickets (either may be null): an op larger than MCCL_PIPELINE_BYTES runs the
// pipelined ring piece by piece as `ready` allows and raises `done` as pieces finish,
// whatever `a` says (allreduce_pieces); a smaller one waits for all of its input, then
// runs `a`.
void allreduce(Collective& c, Algo a, void* buf, size_t count, const Reduction& red,
               const OpTickets& t);
// The pieces a ticketed all-reduce is pipelined in; n == 0 when it is not (one rank,
// nothing to reduce, or at most MCCL_PIPELINE_BYTES: nothing to pipeline). Identical on
// every rank given the same arguments.
Pieces allreduce_pieces(const Options& opts, int size, size_t count, DType dt);
void allgather(Collective& c, Algo a, const void* send, void* recv, size_t nbytes);
void reduce_scatter(Collective& c, Algo a, const void* send, void* recv, size_t count,
                    const Reduction& red);
void broadcast(Collective& c, Algo a, void* buf, size_t nbytes, int root);

// Without a model (views over some ranks, Collective::sub): one round while its link
// bytes are within MCCL_SMALL_ALLREDUCE_BYTES, else the ring; fan-out or chain likewise.
void allreduce(Collective& c, void* buf, size_t count, const Reduction& red);
void broadcast(Collective& c, void* buf, size_t nbytes, int root);

// The algorithms themselves.
void allreduce_ring(Collective& c, void* buf, size_t count, const Reduction& red);
void allreduce_small(Collective& c, void* buf, size_t count, const Reduction& red);
void allreduce_recursive_doubling(Collective& c, void* buf, size_t count, const Reduction& red);
void allreduce_rabenseifner(Collective& c, void* buf, size_t count, const Reduction& red);

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
void allgather_doubling(Collective& c, const void* send, void* recv, size_t nbytes);
void reduce_scatter_ring(Collective& c, const void* send, void* recv, size_t count, const Reduction& red);
void reduce_scatter_halving(Collective& c, const void* send, void* recv, size_t count,
                            const Reduction& red);
void broadcast_fanout(Collective& c, void* buf, size_t nbytes, int root);
void broadcast_chain(Collective& c, void* buf, size_t nbytes, int root);
void broadcast_binomial(Collective& c, void* buf, size_t nbytes, int root);
void broadcast_scatter_allgather(Collective& c, void* buf, size_t nbytes, int root);
void reduce_to_root(Collective& c, void* buf, size_t count, const Reduction& red, int root);
void gather(Collective& c, const void* send, void* recv, size_t nbytes, int root);
void scatter(Collective& c, const void* send, void* recv, size_t nbytes, int root);
void alltoall(Collective& c, const void* send, void* recv, size_t nbytes);
void alltoallv(Collective& c, const void* send, const std::vector<size_t>& send_sizes,
               const std::vector<size_t>& send_offsets, void* recv,
               const std::vector<size_t>& recv_sizes, const std::vector<size_t>& recv_offsets);
void barrier(Collective& c);

// Compressed (compressed.cc, compress/codec.h): each contribution encoded once and reduced
// in float32 by the rank owning its part; all-reduce's results bitwise identical on every
// rank. `residual` (may be null): the buffer's error feedback, `count` floats for the
// all-reduce, count x size() for the reduce-scatter (its input's elements). `pool` (may be
// null): threads that share the codec work (MCCL_COMPRESSION_THREADS); the bits do not
// depend on it. `tickets`: group g's contributions are encoded once `ready` covers its
// input range, and `done` rises over every prefix of groups whose results are final here.
void allreduce_compressed(Collective& c, Codec k, void* buf, size_t count, const Reduction& red,
                          float* residual, CodecPool* pool = nullptr, const OpTickets& tickets = {});
void reduce_scatter_compressed(Collective& c, Codec k, const void* send, void* recv, size_t count,
                               const Reduction& red, float* residual, CodecPool* pool = nullptr);

}  // namespace mccl
