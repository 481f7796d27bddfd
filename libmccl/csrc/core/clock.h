// Time for every layer: a monotonic clock, deadlines that never overflow, and the
// seconds format messages use.
#pragma once
#include <chrono>
#include <string>

namespace mccl {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(double seconds) {
  // Clamp so that "1800 s" or "1e9 s" never overflows the clock's representation.
  if (seconds > 1e7) seconds = 1e7;
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

// Milliseconds left until `d` for poll(), rounded up and clamped to [0, cap_ms]: 0 only
// once `d` has passed.
int ms_until(Deadline d, int cap_ms = 1000);

// "12.5" (one decimal) for messages.
std::string format_seconds(double s);

}  // namespace mccl
