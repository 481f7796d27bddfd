#include "compress/feedback.h"

namespace mccl {

float* Residuals::get(const void* buf, size_t count, DType dt, ReduceOp op, size_t elems) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf);
  const size_t nb = count * dtype_size(dt);
  const uint64_t now = ++clock_;
  const uint64_t stale_after = 2 * uint64_t(entries_.size()) + kStaleSlack;
  float* found = nullptr;
  auto drop = [this](std::list<Entry>::iterator it) {
    bytes_ -= it->residual.size() * sizeof(float);
    return entries_.erase(it);
  };
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (!found && it->addr == a && it->count == count && it->dtype == dt && it->op == op &&
        it->residual.size() == elems) {
      it->last = now;
      found = it->residual.data();
      auto next = std::next(it);
      entries_.splice(entries_.begin(), entries_, it);
      it = next;
      continue;
    }
    // Memory shared with another key: the buffer that owned it is gone (or was re-cut).
    const bool overlaps = a < it->addr + it->nbytes && it->addr < a + nb;
    const bool stale = now - it->last > stale_after;
    it = overlaps || stale ? drop(it) : std::next(it);
  }
  if (found) return found;
  const size_t need = elems * sizeof(float);
  if (max_bytes_ && need > max_bytes_) {
    ++capped_;
    return nullptr;
  }
  if (entries_.size() >= kMaxEntries) drop(std::prev(entries_.end()));
  while (max_bytes_ && !entries_.empty() && bytes_ + need > max_bytes_) {
    ++capped_;
    drop(std::prev(entries_.end()));
  }
  entries_.push_front(Entry{a, nb, count, dt, op, std::vector<float>(elems, 0.f), now});
  bytes_ += need;
  return entries_.front().residual.data();
}

}  // namespace mccl
