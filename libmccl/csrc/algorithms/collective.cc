#include "algorithms/collective.h"

#include <algorithm>

namespace mccl {

uint8_t* Scratch::get(int slot, size_t bytes) {
  if (bytes > cap_[slot]) {
    buf_[slot].reset();  // release first: never hold old and new at once
    buf_[slot].reset(new uint8_t[bytes]);
    cap_[slot] = bytes;
  }
  return buf_[slot].get();
}

void Scratch::release() {
  for (int i = 0; i < kSlots; ++i) {
    buf_[i].reset();
    cap_[i] = 0;
  }
}

void Scratch::trim(size_t keep_bytes) {
  for (int i = 0; i < kSlots; ++i) {
    if (cap_[i] > keep_bytes) {
      buf_[i].reset();
      cap_[i] = 0;
    }
  }
}

size_t auto_segment_bytes(const Options& opts, size_t bytes) {
  if (opts.segment_bytes) return opts.segment_bytes;
  // A quarter of the part keeps >= 4 segments in flight per step; the bounds keep
  // per-message overhead small (64 KiB) and the first segment's latency short (4 MiB).
  return std::clamp<size_t>(bytes / 4, 64 << 10, 4 << 20);
}

}  // namespace mccl
