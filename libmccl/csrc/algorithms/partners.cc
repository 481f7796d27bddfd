#include "algorithms/partners.h"

#include <algorithm>

namespace mccl {

std::vector<int> collective_peers(int r, int n) {
  std::vector<int> out;
  if (n <= 1) return out;
  auto add = [&](int p) {
    if (p >= 0 && p < n && p != r) out.push_back(p);
  };
  add((r + 1) % n);
  add((r + n - 1) % n);
  const int p2 = pow2_floor(n);
  if (r < n - p2) add(r + p2);
  if (r >= p2) add(r - p2);
  if (r < p2) {
    for (int d = 1; d < p2; d *= 2) add(r ^ d);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace mccl
