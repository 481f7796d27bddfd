// Compressed all-reduce and reduce-scatter (MCCL_COMPRESSION, compress/codec.h): every
// contribution is encoded once and reduced once, in float32, by the rank that owns its part.
//
// Why a direct exchange and not the ring: a ring forwards partial sums, so with a lossy codec
// every hop would decode, add and re-encode them, and the error would grow with the number of
// ranks (N-1 quantizations of a growing sum). Here rank r receives chunk r of every peer's
// encoded buffer straight from that peer (reduce-scatter as a direct exchange), adds the
// decoded contributions to its own exact chunk in rank order, and (all-reduce) encodes the
// sum once; the all-gather sends those final bytes, which every rank, the owner included,
// decodes the same way, so every rank ends with the same bits. The error is that of one
// quantization of each contribution plus one of the sum, whatever N (docs/compression.md).
// Each link still carries 2(N-1)/N of the (encoded) buffer, as in the ring.
//
// Pipelined in groups: the buffer is cut into G groups of N chunks; a group's contributions
// are encoded and sent while the groups before it are on the wire or being reduced, and its
// sum is encoded and sent as soon as its last contribution arrived.
//
// With tickets (a device's staging copy, mccld's client copying the input into shared memory)
// group g starts only once `ready` covers its input range (the group reads nothing else:
// P.begin/len of its chunks tile [part_begin(count, G, g), +part_len)), so the first group is
// on the wire while the rest is still being produced; `done` rises over each prefix of groups
// whose n chunks are decoded here. Waiting changes when a group starts, never its bits.
//
// With MCCL_COMPRESSION_THREADS > 1 (`pool`) the codec work of a large chunk is split into
// parts run on the pool's helpers and the worker at once (fork-join: the helpers never touch
// the transport); parts start on int8 block boundaries, so the bytes and sums are those of one
// thread, whatever the thread count.
//
// The worker is also the transport's progress engine: it reads every frame header and lends a
// socket to a receive thread only when it looks, so while it encodes or sums, every link whose
// frame has ended waits (and, once its socket buffers fill, so does the sender). It looks
// (a non-blocking progress round) after each chunk it encodes and each contribution it adds.
//
// Error feedback (`residual`, compress/feedback.h): what the codec dropped of this rank's
// contribution to chunk c is kept at chunk c's elements, and what it dropped of the sum this
// rank owns at its own chunk's, and both are added before the next encoding of the buffer.
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "algorithms/algorithms.h"
#include "compress/codec.h"
#include "compress/codec_pool.h"
#include "core/errors.h"
#include "core/half.h"

namespace mccl {

namespace {

// Groups: enough to overlap encoding, the wire and the reduction (8 for a large op, at least 4
// where the op allows), each chunk's frame big enough to be written by the transport's send
// thread (512 KiB and up, transport README): a smaller one is written only while the worker
// waits, so it would stall behind the next group's encoding. On 2 hosts x 1 Gbit/s, 16 MB int8
// in 8 groups of 272 KB frames took 2.46x off's bus bandwidth.
constexpr size_t kBulkFrameBytes = 512 << 10;
// The transport splits a frame of kStripeBytes or more into one stripe per socket (2 by
// default), and lends a stripe's socket to a receive thread only if at least kLendBytes of
// it remain after the worker's first staging read (up to 64 KiB, header included; transport/
// pair.h, pair_recv.cc, recv_thread.h). A chunk whose frame is striped into less than that
// per stripe is read, and (sealed) opened, by the worker between its codec work. bf16 at
// 16 MB and 8 ranks had exactly such frames (256 KiB: two 128 KiB stripes) and ran at 0.46x of
// off on the 16-core machine while int8's 136 KiB frames (one stripe) ran at 1.87x: the
// suspected cause, not yet measured there (docs/compression.md). Such a chunk is cut to one
// stripe instead; bf16/fp16 bits do not depend on the cut, int8's only on every rank alike.
constexpr size_t kStripeBytes = 256 << 10;              // Pair::kStripeBytes
constexpr size_t kLentStripeBytes = (128 + 64) << 10;   // RecvThread::kLendBytes + a staging read
constexpr size_t kStripes = 2;                          // MCCL_SOCKETS_PER_PEER's default
constexpr size_t kMinChunkElems = 64 << 10;
constexpr size_t kMaxChunkElems = 1 << 20;
constexpr size_t kTargetGroups = 8;
constexpr size_t kMinGroups = 4;
constexpr size_t kMaxGroups = 1 << 14;
// Groups started (encoded and sent) ahead of the first one not yet reduced here.
constexpr size_t kGroupsAhead = 3;
// The smallest part of a chunk given to a codec thread: about 20-40 us of codec work, well
// above the cost of handing it over (a wake-up).
constexpr size_t kMinPartElems = 64 << 10;

struct Part {
  int chunk;  // whose chunk of the group (the rank that owns it)
  size_t begin, len;
};

// Parts of a chunk of `len` elements for `threads` threads: nearly equal, whole int8 blocks
// (the last one may end with a short block, as the chunk does).
void split_chunk(int chunk, size_t len, int threads, std::vector<Part>* parts) {
  const size_t blocks = (len + kInt8Block - 1) / kInt8Block;
  const size_t k = std::clamp<size_t>(len / kMinPartElems, 1, size_t(threads));
  for (size_t i = 0; i < k; ++i) {
    const size_t b0 = part_begin(blocks, k, i) * kInt8Block;
    const size_t b1 = std::min(len, (part_begin(blocks, k, i) + part_len(blocks, k, i)) * kInt8Block);
    if (b1 > b0) parts->push_back(Part{chunk, b0, b1 - b0});
  }
}

enum Phase : uint32_t { kContribution = 0, kResult = 1 };

struct Plan {
  int n = 1, r = 0;
  bool all_gather = true;  // all-reduce; false: reduce-scatter
  size_t count = 0;        // all-reduce: the buffer's elements; reduce-scatter: one block's
  size_t groups = 1;
  Codec codec = Codec::kOff;
  std::vector<size_t> enc_off;  // (g * n + c) -> byte offset of that chunk's encoding
  size_t max_chunk = 0;         // elements

  size_t begin(size_t g, int c) const {
    if (all_gather) {
      const size_t gb = part_begin(count, groups, g), gl = part_len(count, groups, g);
      return gb + part_begin(gl, n, c);
    }
    return size_t(c) * count + part_begin(count, groups, g);
  }
  size_t len(size_t g, int c) const {
    return all_gather ? part_len(part_len(count, groups, g), n, c) : part_len(count, groups, g);
  }
  size_t enc(size_t g, int c) const { return enc_off[g * n + c]; }
  size_t enc_len(size_t g, int c) const { return encoded_bytes(codec, len(g, c)); }
  size_t enc_total() const { return enc_off.back(); }
  // Where chunk r of group g from peer p lands on this rank.
  size_t in_off(size_t g, int p) const { return (g * n + p) * encoded_bytes(codec, max_chunk); }

  static Plan of(int n, int r, bool all_gather, size_t count, Codec k) {
    Plan P;
    P.n = n;
    P.r = r;
    P.all_gather = all_gather;
    P.count = count;
    P.codec = k;
    const size_t per_rank = all_gather ? (count + n - 1) / n : count;  // elements of one rank's part
    const size_t bulk = kBulkFrameBytes * (size_t(1) << 20) / encoded_bytes(k, size_t(1) << 20) + 1;  // a bulk frame
    size_t chunk = std::clamp(std::max(per_rank / kTargetGroups, std::min(bulk, per_rank / kMinGroups)),
                              kMinChunkElems, kMaxChunkElems);
    const size_t frame = encoded_bytes(k, chunk);
    if (frame >= kStripeBytes && frame < kStripes * kLentStripeBytes) {
      // One stripe, a little under the striping threshold (int8's scales round up per block).
      chunk = std::max(kMinChunkElems, (kStripeBytes - (4 << 10)) * (size_t(1) << 20) / encoded_bytes(k, size_t(1) << 20));
    }
    P.groups = std::clamp<size_t>((per_rank + chunk - 1) / chunk, 1, kMaxGroups);
    P.enc_off.assign(P.groups * n + 1, 0);
    for (size_t g = 0; g < P.groups; ++g) {
      for (int c = 0; c < n; ++c) {
        const size_t i = g * n + c;
        P.enc_off[i + 1] = P.enc_off[i] + P.enc_len(g, c);
        P.max_chunk = std::max(P.max_chunk, P.len(g, c));
      }
    }
    return P;
  }
};

// `gate` (all-reduce with tickets; else null): its pieces are the plan's groups.
void run(Collective& c, const Plan& P, const Reduction& red, const uint8_t* in, uint8_t* out,
         float* residual, CodecPool* pool, PieceGate* gate) {
  const int n = P.n, r = P.r;
  const size_t es = red.elem;
  const DType dt = red.dtype;
  const size_t G = P.groups;
  uint8_t* sent = c.scratch.get(0, std::max<size_t>(P.enc_total(), 1));
  uint8_t* arrived = c.scratch.get(1, std::max<size_t>(P.in_off(G, 0), 1));
  uint8_t* final_enc = P.all_gather ? c.scratch.get(2, std::max<size_t>(P.enc_total(), 1)) : nullptr;
  std::vector<float> acc_tmp(dt == DType::kFloat32 ? 0 : P.max_chunk);
  const int threads = pool ? pool->threads() : 1;
  std::vector<Part> parts;
  // Runs fn on every part, on the pool where there is more than one.
  auto run_parts = [&](const std::function<void(const Part&)>& fn) {
    if (!pool || parts.size() <= 1) {
      for (const Part& q : parts) fn(q);
      return;
    }
    pool->run(parts.size(), [&](size_t i) { fn(parts[i]); });
  };

  // One non-blocking round of the transport (worker thread only): what it completes waits in
  // the queue that c.next() reads.
  auto look = [&c] { c.t.progress(Clock::now()); };

  auto tag = [](size_t g, Phase ph) { return static_cast<uint32_t>(g * 2 + ph); };
  auto cookie = [](size_t g, Phase ph, int p) { return uint64_t(g) << 32 | uint64_t(ph) << 24 | uint64_t(p); };
  const char* what = P.all_gather ? "compressed all-reduce" : "compressed reduce-scatter";
  c.t.set_tag_namer([=](uint32_t t) {
    return std::string(what) + (t % 2 ? ": result" : ": contribution") + " of group " +
           std::to_string(t / 2 + 1) + " of " + std::to_string(G);
  });

  size_t outstanding = 0;
  auto start = [&](size_t g) {
    for (int i = 1; i < n; ++i) {  // peers in ring order from here, so no rank is everyone's first
      const int p = (r + i) % n;
      c.recv(p, arrived + P.in_off(g, p), P.enc_len(g, r), tag(g, kContribution), cookie(g, kContribution, p));
      ++outstanding;
      if (P.all_gather) {
        c.recv(p, final_enc + P.enc(g, p), P.enc_len(g, p), tag(g, kResult), cookie(g, kResult, p));
        ++outstanding;
      }
    }
    if (threads > 1) {
      // Every contribution of the group encoded at once, then sent in the same order.
      parts.clear();
      for (int i = 1; i < n; ++i) split_chunk((r + i) % n, P.len(g, (r + i) % n), threads, &parts);
      run_parts([&](const Part& q) {
        const size_t b = P.begin(g, q.chunk) + q.begin;
        encode_part(P.codec, dt, in + b * es, P.len(g, q.chunk), q.begin, q.len, sent + P.enc(g, q.chunk),
                    residual ? residual + b : nullptr);
      });
    }
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      const size_t b = P.begin(g, p);
      if (threads == 1) {
        encode(P.codec, dt, in + b * es, P.len(g, p), sent + P.enc(g, p), residual ? residual + b : nullptr);
      }
      c.send(p, sent + P.enc(g, p), P.enc_len(g, p), tag(g, kContribution), cookie(g, kContribution, p));
      ++outstanding;
      look();
    }
  };
  // Decodes chunk c of group g (encoded at `enc`) into the result, in parts on the pool.
  auto decode_result = [&](size_t g, int ch, const uint8_t* enc, uint8_t* dst) {
    const size_t l = P.len(g, ch);
    if (threads == 1) return decode(P.codec, enc, l, dt, dst);
    parts.clear();
    split_chunk(ch, l, threads, &parts);
    run_parts([&](const Part& q) { decode_part(P.codec, enc, l, q.begin, q.len, dt, dst + q.begin * es); });
  };
  // Chunks of each group not yet final here (all-reduce): at 0 the group is announced done.
  std::vector<int> unfinished(gate ? G : 0, n);
  auto chunk_final = [&](size_t g) {
    if (gate && --unfinished[g] == 0) gate->finished(g);
  };
  auto reduce = [&](size_t g) {
    const size_t b = P.begin(g, r), l = P.len(g, r);
    // Summed in float32: into the result's own place where that is float32, else beside it.
    uint8_t* dst = P.all_gather ? out + b * es : out + (b - size_t(r) * P.count) * es;
    float* acc = dt == DType::kFloat32 ? reinterpret_cast<float*>(dst) : acc_tmp.data();
    parts.clear();
    split_chunk(r, l, threads, &parts);
    run_parts([&](const Part& q) {
      float* a = acc + q.begin;
      const uint8_t* mine = in + (b + q.begin) * es;
      if (dt == DType::kFloat32) {
        if (reinterpret_cast<const uint8_t*>(a) != mine) std::memcpy(a, mine, q.len * es);
      } else {
        load_f32(dt, mine, q.len, a);
      }
      for (int p = 0; p < n; ++p) {  // rank order: the same sum whatever arrived first
        if (p == r) continue;
        decode_add_part(P.codec, arrived + P.in_off(g, p), l, q.begin, q.len, a);
        if (threads == 1) look();  // else this may be a helper thread: it never touches the transport
      }
      if (red.finishes()) finalize_avg(a, q.len, DType::kFloat32, size_t(n));
      if (!P.all_gather) {
        // The reduce-scatter's result never travels: rounded to its dtype once, as the ring's is.
        uint16_t* o = reinterpret_cast<uint16_t*>(dst) + q.begin;
        if (dt == DType::kBFloat16) {
          for (size_t i = 0; i < q.len; ++i) o[i] = float_to_bfloat16(a[i]);
        } else if (dt == DType::kFloat16) {
          for (size_t i = 0; i < q.len; ++i) o[i] = float_to_half(a[i]);
        }
        return;
      }
      // The sum once encoded; the owner keeps what every peer will decode, not its exact sum.
      encode_part(P.codec, DType::kFloat32, a, l, q.begin, q.len, final_enc + P.enc(g, r),
                  residual ? residual + b + q.begin : nullptr);
    });
    if (!P.all_gather) return;
    for (int i = 1; i < n; ++i) {  // on the wire first; this rank's own copy can wait
      const int p = (r + i) % n;
      c.send(p, final_enc + P.enc(g, r), P.enc_len(g, r), tag(g, kResult), cookie(g, kResult, p));
      ++outstanding;
    }
    decode_result(g, r, final_enc + P.enc(g, r), dst);
    chunk_final(g);
  };

  std::vector<int> waiting(G, n - 1);  // contributions still to arrive, per group
  size_t started = 0, reduced = 0;
  auto window_open = [&] { return started < G && started < reduced + kGroupsAhead; };
  while (outstanding > 0 || started < G) {
    while (window_open() && (!gate || gate->ready(started))) start(started++);
    RequestPtr req;
    if (window_open()) {  // only with a gate: the next group's input is not ready yet
      req = gate->next_or_ready(started, outstanding);
      if (!req) continue;
    } else {
      req = c.next();
    }
    --outstanding;
    if (req->is_send) continue;
    const size_t g = static_cast<size_t>(req->cookie >> 32);
    const Phase ph = static_cast<Phase>((req->cookie >> 24) & 0xff);
    const int p = static_cast<int>(req->cookie & 0xffffff);
    if (ph == kResult) {
      decode_result(g, p, final_enc + P.enc(g, p), out + P.begin(g, p) * es);
      chunk_final(g);
      continue;
    }
    if (--waiting[g] > 0) continue;
    // Groups finish in order on each link; reduce every group whose contributions are all here.
    while (reduced < started && waiting[reduced] == 0) reduce(reduced++);
  }
}

}  // namespace

void allreduce_compressed(Collective& c, Codec k, void* buf, size_t count, const Reduction& red,
                          float* residual, CodecPool* pool, const OpTickets& tickets) {
  if (count == 0) return;
  if (c.size() == 1) {  // nothing to exchange: the input is the result once it is there
    const Pieces whole = Pieces::split(count, red.elem, 1);
    PieceGate gate(c, tickets, whole, "compressed all-reduce");
    gate.wait_ready(0);
    gate.finished(0);
    return;
  }
  const Plan P = Plan::of(c.size(), c.rank(), true, count, k);
  uint8_t* b = static_cast<uint8_t*>(buf);
  if (!tickets.any()) return run(c, P, red, b, b, residual, pool, nullptr);
  const Pieces groups = Pieces::split(count, red.elem, P.groups);
  PieceGate gate(c, tickets, groups, "compressed all-reduce");
  run(c, P, red, b, b, residual, pool, &gate);
}

void reduce_scatter_compressed(Collective& c, Codec k, const void* send, void* recv, size_t count,
                               const Reduction& red, float* residual, CodecPool* pool) {
  const int n = c.size();
  if (count == 0) return;
  const uint8_t* in = static_cast<const uint8_t*>(send);
  if (n == 1) {
    std::memmove(recv, send, count * red.elem);
    red.finish(recv, count, n);
    return;
  }
  const Plan P = Plan::of(n, c.rank(), false, count, k);
  if (ranges_overlap(in, count * red.elem * n, recv, count * red.elem)) {
    // The result would overwrite input still to be encoded: work on a copy (slot 2 is free
    // without an all-gather).
    uint8_t* copy = c.scratch.get(2, count * red.elem * n);
    std::memcpy(copy, in, count * red.elem * n);
    in = copy;
  }
  run(c, P, red, in, static_cast<uint8_t*>(recv), residual, pool, nullptr);
}

}  // namespace mccl
