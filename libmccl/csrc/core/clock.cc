#include "core/clock.h"

#include <algorithm>
#include <cstdio>

namespace mccl {

int ms_until(Deadline d, int cap_ms) {
  // Rounded up: rounded down, the last millisecond before `d` became poll(0) in a loop,
  // a busy spin (the ring's 2 ms waits for a producer spent up to half their time so).
  auto left = std::chrono::ceil<std::chrono::milliseconds>(d - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<long long>(left, cap_ms));
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f", s);
  return buf;
}

}  // namespace mccl
