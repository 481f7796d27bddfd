#include "algorithms/ring.h"

#include <algorithm>
#include <string>

namespace mccl {

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

size_t RingLayout::max_chunk() const { return len.empty() ? 0 : *std::max_element(len.begin(), len.end()); }

void ring_pipeline(Collective& c, uint8_t* buf, const RingLayout& L, const RingPhases& ph) {
  const int n = L.n, r = c.rank();
  if (n == 1) return;
  const int right = ring_mod(r + 1, n), left = ring_mod(r - 1, n);
  const size_t S = L.segs, es = L.elem;
  const int steps = n - 1;
  const int rs_steps = ph.reduce_scatter ? steps : 0;
  const int ag_steps = ph.all_gather ? steps : 0;
  const int sh = ph.shift;

  auto rs_send_chunk = [&](int s) { return ring_mod(r - s + sh, n); };
  auto rs_recv_chunk = [&](int s) { return ring_mod(r - s - 1 + sh, n); };
  auto ag_send_chunk = [&](int s) { return ring_mod(r + 1 + sh - s, n); };
  auto ag_recv_chunk = [&](int s) { return ring_mod(r + sh - s, n); };
  // Global step g: reduce-scatter steps first, then all-gather steps.
  auto tag = [&](int g, size_t j) { return static_cast<uint32_t>(size_t(g) * S + j); };
  auto cookie = [](int g, size_t j) { return uint64_t(g) << 32 | uint64_t(j); };
  auto at = [&](int chunk, size_t j) { return buf + (L.off[chunk] + L.seg_begin(chunk, j)) * es; };
  auto bytes = [&](int chunk, size_t j) { return L.seg_len(chunk, j) * es; };

  // Segment j of every step of one parity lands at the same fixed slot: chunks differ in
  // length by one element, so chunk-relative offsets of different steps could overlap.
  const size_t stride = (L.max_chunk() + S - 1) / S;
  uint8_t* temp[2] = {nullptr, nullptr};
  if (rs_steps > 0) {
    size_t slot_bytes = std::max<size_t>(stride * S * es, 1);
    temp[0] = c.scratch.get(0, slot_bytes);
    temp[1] = c.scratch.get(1, slot_bytes);
  }
  auto temp_at = [&](int s, size_t j) { return temp[s % 2] + j * stride * es; };

  c.t.set_tag_namer([=](uint32_t t) {
    const int g = static_cast<int>(t / S);
    const bool rs = g < rs_steps;
    return std::string(rs ? "reduce-scatter" : "all-gather") + " step " +
           std::to_string(rs ? g + 1 : g - rs_steps + 1) + " of " + std::to_string(steps) +
           ", segment " + std::to_string(t % S + 1) + " of " + std::to_string(S);
  });

  size_t outstanding = 0;
  auto post_rs_recv = [&](int s, size_t j) {
    int ch = rs_recv_chunk(s);
    c.recv(left, temp_at(s, j), bytes(ch, j), tag(s, j), cookie(s, j));
    ++outstanding;
  };
  auto send = [&](int g, int chunk, size_t j) {
    c.send(right, at(chunk, j), bytes(chunk, j), tag(g, j));
    ++outstanding;
  };

  // Post receives ahead, then start every segment's first send.
  for (size_t j = 0; j < S; ++j) {
    for (int s = 0; s < std::min(rs_steps, 2); ++s) post_rs_recv(s, j);
  }
  for (int s = 0; s < ag_steps; ++s) {
    int g = rs_steps + s, ch = ag_recv_chunk(s);
    for (size_t j = 0; j < S; ++j) {
      c.recv(left, at(ch, j), bytes(ch, j), tag(g, j), cookie(g, j));
      ++outstanding;
    }
  }
  for (size_t j = 0; j < S; ++j) {
    if (rs_steps > 0) {
      send(0, rs_send_chunk(0), j);
    } else {
      send(0, ag_send_chunk(0), j);
    }
  }

  while (outstanding > 0) {
    RequestPtr req = c.next();
    --outstanding;
    if (req->is_send) continue;
    const int g = static_cast<int>(req->cookie >> 32);
    const size_t j = static_cast<size_t>(req->cookie & 0xFFFFFFFFu);
    if (g < rs_steps) {
      const int s = g, ch = rs_recv_chunk(s);
      ph.fn(temp_at(s, j), at(ch, j), L.seg_len(ch, j));
      if (s + 2 < rs_steps) post_rs_recv(s + 2, j);  // this temp slot is free again
      if (s + 1 < rs_steps) {
        send(s + 1, rs_send_chunk(s + 1), j);  // == ch, just reduced
      } else if (ag_steps > 0) {
        send(rs_steps, ag_send_chunk(0), j);  // == ch, now final
      }
    } else {
      const int s = g - rs_steps;
      if (s + 1 < ag_steps) send(g + 1, ag_send_chunk(s + 1), j);  // == the chunk just received
    }
  }
}

}  // namespace mccl
