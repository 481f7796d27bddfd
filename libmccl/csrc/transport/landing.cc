#include "transport/landing.h"

#include <sys/socket.h>

#include <algorithm>
#include <cstring>

namespace mccl {

void Landing::start(uint8_t* dst, size_t n, ReduceFn fn, size_t elem) {
  dst_ = dst;
  left_ = n;
  fn_ = fn;
  elem_ = fn ? elem : 1;
  carry_n_ = 0;
}

void Landing::put(const uint8_t* src, size_t n) {
  if (mac_) mac_->update(src, n);
  left_ -= n;
  if (!fn_) {
    std::memcpy(dst_, src, n);
    dst_ += n;
    return;
  }
  if (carry_n_) {
    const size_t take = std::min(elem_ - carry_n_, n);
    std::memcpy(carry_ + carry_n_, src, take);
    carry_n_ += take;
    src += take;
    n -= take;
    if (carry_n_ < elem_) return;
    fn_(carry_, dst_, 1);
    dst_ += elem_;
    carry_n_ = 0;
  }
  const size_t whole = n - n % elem_;
  if (whole) fn_(src, dst_, whole / elem_);  // the kernels accept any alignment
  dst_ += whole;
  carry_n_ = n - whole;
  std::memcpy(carry_, src + whole, carry_n_);
}

ssize_t Landing::recv_from(int fd, int flags, uint8_t* stage, size_t cap) {
  if (!fn_) {
    ssize_t r = ::recv(fd, dst_, left_, flags);
    if (r > 0) {
      if (mac_) mac_->update(dst_, static_cast<size_t>(r));
      dst_ += r;
      left_ -= static_cast<size_t>(r);
    }
    return r;
  }
  // The split element's first bytes go in front, so the stage holds whole elements from
  // its start and is reduced in one call.
  std::memcpy(stage, carry_, carry_n_);
  ssize_t r = ::recv(fd, stage + carry_n_, next_read(cap), flags);
  if (r <= 0) return r;
  if (mac_) mac_->update(stage + carry_n_, static_cast<size_t>(r));
  left_ -= static_cast<size_t>(r);
  const size_t have = carry_n_ + static_cast<size_t>(r);
  const size_t whole = have - have % elem_;
  if (whole) fn_(stage, dst_, whole / elem_);
  dst_ += whole;
  carry_n_ = have - whole;
  std::memcpy(carry_, stage + whole, carry_n_);
  return r;
}

}  // namespace mccl
