// The building blocks of the power-of-two algorithms (recursive doubling and halving,
// binomial trees) and of folding a world that is not a power of two onto one.
//
// Folding: with P = pow2_floor(N), rank r >= P is an "extra" rank; it hands its input to
// its fold partner r - P before the core runs, and gets the result back from it after.
// The P core ranks run the power-of-two algorithm among themselves, talking only to their
// hypercube partners i ^ 2^k. Every peer named here is in collective_peers (partners.h).
//
// Blocks: the hypercube steps work on a buffer split into P blocks, block b being
// [off[b], off[b+1]) in units of `unit` bytes; block b ends on core rank b (halving) or
// starts there (doubling).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algorithms/collective.h"
#include "algorithms/partners.h"
#include "reduce/reduce.h"

namespace mccl {

struct Fold {
  int n = 1;        // ranks
  int p = 1;        // core ranks, pow2_floor(n)
  int r = 0;        // this rank
  int steps = 0;    // log2(p)
  bool extra() const { return r >= p; }
  // The extra rank folded onto core rank r, or -1.
  int extra_of_core() const { return r + p < n ? r + p : -1; }
  int core_of_extra() const { return r - p; }

  static Fold of(int n, int r) {
    Fold f;
    f.n = n;
    f.p = pow2_floor(n);
    f.r = r;
    for (int d = 1; d < f.p; d *= 2) ++f.steps;
    return f;
  }
};

// The P + 1 block boundaries of `total` units split as evenly as the ring splits them.
std::vector<size_t> even_blocks(size_t total, int p);

// inout = op(low, high), where `mine` is this rank's operand and `theirs` its partner's,
// `i_am_low` says whose goes first. Both partners of a pair then compute the very same
// bits even where the kernel is not commutative bit for bit (a NaN's payload, MIN/MAX
// with NaN): the kernel is always called as fn(in = high, inout = low).
// `mine` receives the result; `theirs` may be overwritten.
void combine_ordered(const Reduction& red, uint8_t* mine, uint8_t* theirs, size_t count,
                     bool i_am_low);

// Reduce-scatter by recursive halving over the core: core rank i ends holding block i of
// `work` reduced over all core ranks (other blocks are left partly reduced). `unit` is
// the element size. What arrives is reduced straight into place (fn(theirs, mine)): each
// block's final bits are computed by its one owner, so no operand order needs agreeing.
// Tags tag0 .. tag0+steps-1.
void halving_reduce_scatter(Collective& c, const Fold& f, uint8_t* work,
                            const std::vector<size_t>& off, const Reduction& red, uint32_t tag0);

// All-gather by recursive doubling over the core: core rank i starts holding block i of
// `work` and ends holding all of them. `rel` (0 for none) is XORed into the rank to find
// whose block a rank holds: rank i holds block i ^ rel (broadcast from a root != 0).
// Tags tag0 .. tag0+steps-1.
void doubling_allgather(Collective& c, const Fold& f, uint8_t* work,
                        const std::vector<size_t>& off, size_t unit, uint32_t tag0, int rel = 0);

// Names the tags of a folded hypercube algorithm for timeout messages: 0 the fold-in,
// then `steps` steps of phase `a`, `steps` of phase `b` (null: none), then the fold-out.
void name_tags(Collective& c, int steps, const char* a, const char* b = nullptr);

// Send or receive `n` bytes and wait for it; zero-byte transfers are skipped on both sides.
void send_wait(Collective& c, int peer, const void* buf, size_t n, uint32_t tag);
void recv_wait(Collective& c, int peer, void* buf, size_t n, uint32_t tag);

}  // namespace mccl
