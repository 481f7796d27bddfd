#include "algorithms/ring.h"

#include <algorithm>
#include <string>

#include "core/errors.h"

namespace mccl {

namespace {

// Reduce-scatter receive window: about this many bytes of segments posted ahead, and at
// least this many segments, so a burst from the left neighbour lands in place instead of
// being buffered as unexpected and copied.
constexpr size_t kRecvWindowBytes = 32 << 20;
constexpr size_t kMinRecvSlots = 8;
// At most this many pieces of a pieced op in flight. Started all at once (a producer
// ahead of the links makes every piece ready at the start), they all finished at the very
// end, so `done` stood still for 95 % of the op and its consumer (mccld's client copying
// results out) worked after the ring instead of behind it. A few pieces keep the links as
// busy; the later ones start as the first finish, so `done` rises throughout.
constexpr size_t kPiecesInFlight = 4;

}  // namespace

RingLayout RingLayout::balanced(int n, size_t count, size_t elem, size_t seg_bytes) {
  RingLayout L;
  L.n = n;
  L.elem = elem;
  L.count = count;
  L.off.resize(n);
  L.len.resize(n);
  for (int c = 0; c < n; ++c) {
    L.off[c] = part_begin(count, n, c);
    L.len[c] = part_len(count, n, c);
  }
  size_t seg_elems = std::max<size_t>(1, seg_bytes / elem);
  size_t segs = (L.max_chunk() + seg_elems - 1) / seg_elems;
  // Tags are u32 = step * segs + segment; keep well inside that.
  size_t max_segs = std::max<size_t>(1, (size_t(1) << 30) / (2 * size_t(n)));
  L.segs = std::min(std::max<size_t>(segs, 1), max_segs);
  return L;
}

RingLayout RingLayout::pieced(int n, const Pieces& p) {
  RingLayout L;
  L.n = n;
  L.elem = p.elem;
  L.count = p.count;
  L.segs = std::max<size_t>(p.n, 1);
  L.pieces = &p;
  return L;
}

size_t RingLayout::max_chunk() const {
  if (pieces) return part_len(pieces->count, n, 0);
  return len.empty() ? 0 : *std::max_element(len.begin(), len.end());
}

size_t RingLayout::max_seg() const {
  if (pieces) return part_len(pieces->piece_elems, n, 0);
  return (max_chunk() + segs - 1) / segs;
}

void ring_pipeline(Collective& c, uint8_t* buf, const RingLayout& L, const RingPhases& ph) {
  const int n = L.n, r = c.rank();
  if (n == 1) return;
  const int right = ring_mod(r + 1, n), left = ring_mod(r - 1, n);
  const size_t S = L.segs, es = L.elem;
  const int steps = n - 1;
  const int rs_steps = ph.reduce_scatter ? steps : 0;
  const int ag_steps = ph.all_gather ? steps : 0;
  const int sh = ph.shift;
  const bool in_place = ph.result == nullptr;
  PieceGate* const gate = ph.gate;
  if (gate && !(L.pieces && in_place && rs_steps > 0 && ag_steps > 0)) {
    throw_error(ErrorKind::kGeneric, "[engine] internal error: a gated ring needs a pieced layout, "
                                     "in place, with both phases");
  }

  auto rs_send_chunk = [&](int s) { return ring_mod(r - s + sh, n); };
  auto rs_recv_chunk = [&](int s) { return ring_mod(r - s - 1 + sh, n); };
  auto ag_send_chunk = [&](int s) { return ring_mod(r + 1 + sh - s, n); };
  auto ag_recv_chunk = [&](int s) { return ring_mod(r + sh - s, n); };
  // Global step g: reduce-scatter steps first, then all-gather steps.
  auto tag = [&](int g, size_t j) { return static_cast<uint32_t>(size_t(g) * S + j); };
  auto cookie = [](int g, size_t j) { return uint64_t(g) << 32 | uint64_t(j); };
  auto at = [&](int chunk, size_t j) { return buf + L.seg_off(chunk, j) * es; };
  auto bytes = [&](int chunk, size_t j) { return L.seg_len(chunk, j) * es; };

  // In place, reduce-scatter receives are reduce-receives straight into `buf` (the
  // thread reading the socket adds the segment in as it arrives, transport/landing.h), so
  // they need no scratch and are all posted up front: a region of `buf` is reduced into
  // only by its one receive, and read by the send that follows its completion. With a
  // gate a piece's receives are posted when it starts instead: they reduce into its input,
  // which must be ready first (early frames wait in the transport meanwhile).
  // Out of place, a segment arrives in one of W segment-sized scratch slots: item
  // g = s*S + j uses slot g % W, holds the partial sum until the send forwarding it has
  // completed, then hands the slot to item g + W. Items arrive from the left in about
  // that order, so a few in flight suffice; a window of whole chunks would make a 256 MB
  // reduce-scatter allocate (and page-fault in) 128 MB of scratch per op. The last step
  // needs no slot (it lands in ph.result).
  // Slots are `stride` elements: chunks differ in length by one element, so segment
  // lengths of different steps differ too.
  const size_t stride = L.max_seg();
  const int slot_steps = in_place ? 0 : rs_steps - 1;
  const size_t slot_items = size_t(std::max(slot_steps, 0)) * S;
  const size_t window = std::min(slot_items, std::max(kMinRecvSlots,
                                                      kRecvWindowBytes / std::max<size_t>(stride * es, 1)));
  uint8_t* temp = nullptr;
  if (slot_items > 0) temp = c.scratch.get(0, std::max<size_t>(window * stride * es, 1));
  auto temp_at = [&](int s, size_t j) { return temp + ((size_t(s) * S + j) % window) * stride * es; };
  auto result_at = [&](int chunk, size_t j) {
    return ph.result + (L.seg_off(chunk, j) - L.off[chunk]) * es;
  };

  c.t.set_tag_namer([=](uint32_t t) {
    const int g = static_cast<int>(t / S);
    const bool rs = g < rs_steps;
    return std::string(rs ? "reduce-scatter" : "all-gather") + " step " +
           std::to_string(rs ? g + 1 : g - rs_steps + 1) + " of " + std::to_string(steps) + ", " +
           (gate ? "piece " : "segment ") + std::to_string(t % S + 1) + " of " + std::to_string(S);
  });

  size_t outstanding = 0;
  auto post_rs_recv = [&](int s, size_t j) {
    int ch = rs_recv_chunk(s);
    if (in_place) {
      c.recv_reduce(left, at(ch, j), bytes(ch, j), tag(s, j), ph.fn, es, cookie(s, j));
    } else {
      uint8_t* dst = s < slot_steps ? temp_at(s, j) : result_at(ch, j);
      c.recv(left, dst, bytes(ch, j), tag(s, j), cookie(s, j));
    }
    ++outstanding;
  };
  auto release_slot = [&](int s, size_t j) {
    const size_t next = size_t(s) * S + j + window;  // takes over this slot
    if (next < slot_items) post_rs_recv(static_cast<int>(next / S), next % S);
  };
  // A send's cookie is its (step, segment), with kFreesSlot when its completion frees the
  // slot of the step before (an out-of-place partial sum).
  constexpr uint64_t kFreesSlot = uint64_t(1) << 63;
  std::vector<uint32_t> sends_out(gate ? S : 0);     // per piece: sends not completed yet
  std::vector<uint32_t> final_chunks(gate ? S : 0);  // per piece: chunks holding final bits here
  auto send = [&](int g, const uint8_t* src, size_t n_bytes, size_t j, bool frees_slot) {
    c.send(right, src, n_bytes, tag(g, j), cookie(g, j) | (frees_slot ? kFreesSlot : 0));
    ++outstanding;
    if (gate) ++sends_out[j];
  };
  auto send_chunk = [&](int g, int chunk, size_t j) { send(g, at(chunk, j), bytes(chunk, j), j, false); };
  // Gated: piece j is done here once all its chunks are final and no send reads it.
  size_t retired = 0;
  std::vector<bool> is_retired(gate ? S : 0);
  auto retire_if_done = [&](size_t j) {
    if (gate && !is_retired[j] && final_chunks[j] == size_t(n) && sends_out[j] == 0) {
      is_retired[j] = true;
      ++retired;
      gate->finished(j);
    }
  };
  auto post_ag_recv = [&](int s, size_t j) {
    const int g = rs_steps + s, ch = ag_recv_chunk(s);
    c.recv(left, at(ch, j), bytes(ch, j), tag(g, j), cookie(g, j));
    ++outstanding;
  };
  // A gated piece posts its receives as it starts, reduce-scatter steps first (so a stall
  // is reported at the first step it blocks). Its all-gather data cannot come earlier:
  // it carries the result of this rank's first send of the piece.
  auto start = [&](size_t j) {
    if (gate) {
      for (int s = 0; s < rs_steps; ++s) post_rs_recv(s, j);
      for (int s = 0; s < ag_steps; ++s) post_ag_recv(s, j);
    }
    send_chunk(0, rs_steps > 0 ? rs_send_chunk(0) : ag_send_chunk(0), j);
  };

  // Post receives ahead (the slot window, and every step that needs no slot), then start
  // every segment's first send; gated pieces start as their input becomes ready.
  for (size_t g = 0; g < window; ++g) post_rs_recv(static_cast<int>(g / S), g % S);
  for (int s = std::max(slot_steps, 0); s < rs_steps && !gate; ++s) {
    for (size_t j = 0; j < S; ++j) post_rs_recv(s, j);
  }
  for (int s = 0; s < ag_steps && !gate; ++s) {
    for (size_t j = 0; j < S; ++j) post_ag_recv(s, j);
  }
  size_t started = 0;
  if (!gate) {
    for (; started < S; ++started) start(started);
  }

  auto window_open = [&] { return started < S && started < retired + kPiecesInFlight; };
  while (outstanding > 0 || started < S) {
    RequestPtr req;
    while (window_open() && gate->ready(started)) start(started++);
    if (window_open()) {
      // Waiting for the producer as well as the links (pieces.h).
      req = gate->next_or_ready(started, outstanding);
      if (!req) continue;
    } else {
      req = c.next();  // every piece started, or as many as may be in flight: only the links
    }
    --outstanding;
    if (req->is_send) {
      const size_t j = static_cast<size_t>(req->cookie & 0xFFFFFFFFu);
      if (req->cookie & kFreesSlot) {
        release_slot(static_cast<int>((req->cookie & ~kFreesSlot) >> 32) - 1, j);
      }
      if (gate) {
        --sends_out[j];
        retire_if_done(j);
      }
      continue;
    }
    const int g = static_cast<int>(req->cookie >> 32);
    const size_t j = static_cast<size_t>(req->cookie & 0xFFFFFFFFu);
    if (g < rs_steps && in_place) {
      const int s = g;  // the segment is reduced into buf already
      if (s + 1 < rs_steps) {
        send_chunk(s + 1, rs_send_chunk(s + 1), j);  // == ch, just reduced
      } else {
        if (gate) ++final_chunks[j];  // this rank's own chunk of the piece
        if (ag_steps > 0) send_chunk(rs_steps, ag_send_chunk(0), j);  // == ch, now final
      }
    } else if (g < rs_steps) {
      // Out of place: add this rank's contribution to what arrived, where it arrived.
      const int s = g, ch = rs_recv_chunk(s);
      uint8_t* sum = s < slot_steps ? temp_at(s, j) : result_at(ch, j);
      ph.fn(at(ch, j), sum, L.seg_len(ch, j));
      if (s < slot_steps) send(s + 1, sum, bytes(ch, j), j, true);
    } else {
      const int s = g - rs_steps;
      if (gate) ++final_chunks[j];
      if (s + 1 < ag_steps) send_chunk(g + 1, ag_send_chunk(s + 1), j);  // == the chunk just received
    }
    retire_if_done(j);
  }
}

}  // namespace mccl
