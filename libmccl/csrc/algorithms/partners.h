// Which peers the collective algorithms talk to, so a rank links only to those (O(log N)
// of them) instead of to every rank. Every algorithm that runs on the whole communicator
// keeps to this set; ops that need other peers (gather, scatter, all-to-all,
// point-to-point) link to them when first used.
//
// The set, for rank r of N, P the largest power of two <= N:
//   ring neighbours        r-1, r+1 (mod N)
//   fold partner           r+P if r < N-P; r-P if r >= P (the extra ranks of a
//                          non-power-of-two world fold onto the first N-P)
//   hypercube partners     r XOR 2^k for every k < log2 P, when r < P
// It is symmetric (r is in the set of each of its members), so both ends agree a link is
// needed. Hierarchical algorithms (topology) add their own peers through groups.
#pragma once
#include <vector>

namespace mccl {

// The largest power of two <= n (n >= 1).
inline int pow2_floor(int n) {
  int p = 1;
  while (p <= n / 2) p *= 2;
  return p;
}

// Sorted, without r itself.
std::vector<int> collective_peers(int r, int n);

}  // namespace mccl
