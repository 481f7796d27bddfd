// Topology-aware all-reduce: hosts grouped by switch, so the bytes that cross the
// (oversubscribed) uplinks between switches are one buffer's worth per switch instead of
// the flat ring's zig-zag across them.
//
//   1. fold:    ranks of a switch beyond the smallest switch's size (`width`) send their
//               buffer to a core rank of their switch, which reduces it in;
//   2. intra:   ring reduce-scatter among the `width` core ranks of each switch: core rank
//               i holds slice i of its switch's sum;
//   3. inter:   ring all-reduce of slice i among the core ranks i of every switch (one per
//               switch: the only traffic on the uplinks); AVG is finished here, once;
//   4. intra:   ring all-gather among the core ranks of each switch;
//   5. unfold:  core ranks send the result back to the ranks that folded onto them.
// Every element of the result is computed once, by one ring all-reduce, and then copied, so
// every rank holds the same bits. Unequal switches cost only their extra ranks a whole-
// buffer hop to a neighbour on the same switch, and keep the slices equal across switches.
//
// allreduce_switch_ring is the other way (MCCL_HIERARCHY=ring): the flat ring over the ranks
// in switch order. It moves 2(N-1)/N of the buffer over each uplink each way against the
// tree's 2(k-1)/k, in one pipelined pass instead of three phases one after the other, so it
// wins while one host's rate fits the uplink (2:1 and the like) and the tree wins once the
// uplinks are the bottleneck, or on latency (2(w-1) + 2(k-1) steps against 2(N-1)).
//
// The phases run over views of the op (Collective::sub) with tag ranges of their own, each
// sized from the layout it runs, so frames of two phases between the same two ranks never
// match. A ticketed op runs piece by piece (the same cut as the flat ring's: pieces.h), so
// a producer that feeds `ready` a few pieces ahead of `done` is never waited for forever.
#include <algorithm>
#include <cstring>
#include <map>
#include <string>

#include "algorithms/algorithms.h"
#include "algorithms/ring.h"
#include "core/errors.h"
#include "reduce/reduce.h"

namespace mccl {

Hierarchy Hierarchy::of(const std::vector<int>& switch_of_rank, int rank) {
  Hierarchy h;
  std::map<int, std::vector<int>> by_switch;  // ordered by switch id: the same order everywhere
  for (size_t r = 0; r < switch_of_rank.size(); ++r) {
    by_switch[switch_of_rank[r]].push_back(static_cast<int>(r));
  }
  if (by_switch.size() < 2) return h;
  h.width = static_cast<int>(switch_of_rank.size());
  for (auto& kv : by_switch) {
    h.width = std::min(h.width, static_cast<int>(kv.second.size()));
    h.groups.push_back(std::move(kv.second));
  }
  for (auto& g : h.groups) {
    h.cores.emplace_back(g.begin(), g.begin() + h.width);
    h.ring_order.insert(h.ring_order.end(), g.begin(), g.end());
    h.max_group = std::max(h.max_group, static_cast<int>(g.size()));
  }
  h.slices.resize(h.width);
  for (int j = 0; j < h.width; ++j) {
    for (auto& g : h.groups) h.slices[j].push_back(g[j]);
  }
  for (size_t g = 0; g < h.groups.size(); ++g) {
    for (size_t i = 0; i < h.groups[g].size(); ++i) {
      if (h.groups[g][i] == rank) {
        h.group = static_cast<int>(g);
        h.index = static_cast<int>(i);
      }
    }
  }
  uint32_t f = 2166136261u;  // FNV-1a over (switch of every rank) and the rank count
  for (int sw : switch_of_rank) f = (f ^ static_cast<uint32_t>(sw)) * 16777619u;
  f = (f ^ static_cast<uint32_t>(switch_of_rank.size())) * 16777619u;
  h.fingerprint = static_cast<int32_t>(f & 0x7fffffff);
  return h;
}

std::vector<int> Hierarchy::peers(bool ring) const {
  std::vector<int> out;
  if (!active() || group < 0) return out;
  const auto& g = groups[group];
  const int me = g[index];
  if (ring) {
    const int n = static_cast<int>(ring_order.size());
    const int at = static_cast<int>(std::find(ring_order.begin(), ring_order.end(), me) - ring_order.begin());
    for (int d : {-1, 1}) out.push_back(ring_order[ring_mod(at + d, n)]);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }
  if (index >= width) {
    out.push_back(g[index % width]);
    return out;
  }
  const int k = static_cast<int>(groups.size());
  const auto& core = cores[group];
  const auto& slice = slices[index];
  for (int d : {-1, 1}) {
    out.push_back(core[ring_mod(index + d, width)]);
    out.push_back(slice[ring_mod(group + d, k)]);
  }
  for (size_t e = index + width; e < g.size(); e += width) out.push_back(g[e]);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  out.erase(std::remove(out.begin(), out.end(), me), out.end());
  return out;
}

namespace {

// Tags one ring run may use: step * segs + segment over 2(n-1) steps (ring.cc).
uint64_t ring_tags(const RingLayout& L) { return 2 * uint64_t(L.n) * L.segs; }

class Run {
 public:
  Run(Collective& c, const Hierarchy& h, const Reduction& red, size_t world)
      : c_(c), h_(h), red_(red), world_(world), sum_(red) {
    // The phases combine; only the inter-switch result is finished (AVG: divided once).
    if (red.op == ReduceOp::kAvg) sum_.op = ReduceOp::kSum;
  }

  // All-reduces elements [0, count) of `base`.
  void piece(uint8_t* base, size_t count) {
    const size_t es = red_.elem, bytes = count * es;
    const auto& group = h_.groups[h_.group];
    const int w = h_.width, me = h_.index;
    const bool core = me < w;

    const int k = static_cast<int>(h_.groups.size());
    const RingLayout intra = RingLayout::balanced(w, count, es, seg(count, w));
    uint64_t inter_need = 0;
    for (int j = 0; j < w; ++j) {
      inter_need = std::max(inter_need, ring_tags(inter_layout(intra.len[j])));
    }
    // Every rank takes the same tag ranges in the same order, whatever its switch or role.
    const uint32_t fold_tags = take(h_.max_group), rs_tags = take(ring_tags(intra));
    const uint32_t inter_tags = take(inter_need), ag_tags = take(ring_tags(intra));
    const uint32_t unfold_tags = take(h_.max_group);

    // 1. fold, in the extra ranks' order, one at a time: two reduce-receives into the same
    // buffer could run at once on the transport's reading threads.
    Collective fold = c_.sub(group, fold_tags);
    if (!core) {
      fold.send(me % w, base, bytes, me);
      fold.wait_all(1);
    } else {
      for (int e = me + w; e < static_cast<int>(group.size()); e += w) {
        fold.recv_reduce(e, base, bytes, e, sum_.fn, es);
        fold.wait_all(1);
      }
    }

    if (core) {
      // 2. reduce-scatter within the switch: core rank i ends owning chunk i.
      RingPhases rs;
      rs.all_gather = false;
      rs.shift = -1;
      rs.fn = sum_.fn;
      Collective in = c_.sub(h_.cores[h_.group], rs_tags);
      ring_pipeline(in, base, intra, rs);

      // 3. all-reduce of chunk i across the switches, finished once.
      uint8_t* slice = base + intra.off[me] * es;
      const size_t n = intra.len[me];
      RingPhases ar;
      ar.fn = sum_.fn;
      Collective across = c_.sub(h_.slices[me], inter_tags);
      ring_pipeline(across, slice, inter_layout(n), ar);
      red_.finish(slice, n, world_);

      // 4. all-gather within the switch.
      RingPhases ag;
      ag.reduce_scatter = false;
      ag.shift = -1;
      Collective out = c_.sub(h_.cores[h_.group], ag_tags);
      ring_pipeline(out, base, intra, ag);
    }

    // 5. unfold.
    Collective unfold = c_.sub(group, unfold_tags);
    if (!core) {
      unfold.recv(me % w, base, bytes, me);
      unfold.wait_all(1);
    } else {
      size_t sends = 0;
      for (int e = me + w; e < static_cast<int>(group.size()); e += w, ++sends) {
        unfold.send(e, base, bytes, e);
      }
      unfold.wait_all(sends);
    }
  }

 private:
  RingLayout inter_layout(size_t n) const {
    const int k = static_cast<int>(h_.groups.size());
    return RingLayout::balanced(k, n, red_.elem, seg(n, k));
  }
  size_t seg(size_t count, int parts) const {
    return auto_segment_bytes(c_.opts, (count + parts - 1) / parts * red_.elem);
  }
  // The next `n` tags of the op (the same on every rank: every rank takes the same ranges).
  uint32_t take(uint64_t n) {
    if (tag_ + n >= (uint64_t(1) << 32)) {
      throw_error(ErrorKind::kGeneric, "[engine] hierarchical all-reduce: out of tags; raise "
                                       "MCCL_PIPELINE_BYTES or MCCL_SEGMENT_BYTES");
    }
    const uint32_t at = static_cast<uint32_t>(tag_);
    tag_ += n;
    return at;
  }

  Collective& c_;
  const Hierarchy& h_;
  const Reduction& red_;
  const size_t world_;
  Reduction sum_;
  uint64_t tag_ = 0;
};

}  // namespace

void allreduce_hierarchical(Collective& c, void* buf, size_t count, const Reduction& red,
                            const Hierarchy& h, const OpTickets& t) {
  if (count == 0) return;
  if (!h.active() || h.group < 0) {
    throw_error(ErrorKind::kGeneric, "[engine] internal error: hierarchical all-reduce without "
                                     "groups, or this rank in none");
  }
  Run run(c, h, red, static_cast<size_t>(c.size()));
  uint8_t* b = static_cast<uint8_t*>(buf);
  const Pieces p = allreduce_pieces(c.opts, c.size(), count, red.dtype);
  if (!t.any() || p.n == 0) {
    const Pieces whole = Pieces::cut(count, red.elem, count * red.elem, 1);
    PieceGate gate(c, t, whole, "allreduce");
    gate.wait_ready(0);
    run.piece(b, count);
    gate.finished(0);
    return;
  }
  PieceGate gate(c, t, p, "allreduce");
  for (size_t j = 0; j < p.n; ++j) {
    gate.wait_ready(j);
    run.piece(b + p.begin(j) * p.elem, p.len(j));
    gate.finished(j);
  }
}

void allreduce_switch_ring(Collective& c, void* buf, size_t count, const Reduction& red,
                           const Hierarchy& h, const OpTickets& t) {
  // Same size, same pieces as the flat all-reduce: only the order of the ranks differs.
  Collective ring = c.sub(h.ring_order, 0);
  if (t.any()) {
    allreduce(ring, Algo::kRing, buf, count, red, t);
  } else {
    allreduce(ring, Algo::kRing, buf, count, red);
  }
}

}  // namespace mccl
