#include "transport/landing.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "core/errors.h"

namespace mccl {

void Landing::start(uint8_t* dst, size_t n, const Sink* sink) {
  dst_ = dst;
  left_ = n;
  sink_ = sink;
  unit_ = sink ? sink->unit() : 1;
  carry_n_ = 0;
  cipher_ = nullptr;
}

void Landing::unseal(RecordCipher* cipher, RecordStream stream, const uint8_t* aad, size_t aad_n) {
  cipher_ = cipher;
  stream_ = stream;
  aad_ = aad;
  aad_n_ = aad_n;
  base_ = dst_;
  n_ = left_;
  wire_n_ = sealed_bytes(n_);
  pos_ = 0;
  opened_ = 0;
  if (!slots_) slots_.reset(new uint8_t[kSlots * kRecordBytes]);
}

// ---------------------------------------------------------------- plain payloads

bool Landing::put(const uint8_t* src, size_t n) {
  if (cipher_) {
    while (n > 0) {
      size_t len = 0;
      uint8_t* to = target(&len);
      len = std::min(len, n);
      std::memcpy(to, src, len);
      pos_ += len;
      src += len;
      n -= len;
      if (!open_ready()) return false;
    }
    return true;
  }
  left_ -= n;
  if (!sink_) {
    std::memcpy(dst_, src, n);
    dst_ += n;
    return true;
  }
  if (carry_n_) {
    const size_t take = std::min(unit_ - carry_n_, n);
    std::memcpy(carry_ + carry_n_, src, take);
    carry_n_ += take;
    src += take;
    n -= take;
    if (carry_n_ < unit_) return true;
    sink_->consume(carry_, dst_, unit_);
    dst_ += unit_;
    carry_n_ = 0;
  }
  const size_t whole = n - n % unit_;
  if (whole) sink_->consume(src, dst_, whole);  // a sink accepts any alignment
  dst_ += whole;
  carry_n_ = n - whole;
  std::memcpy(carry_, src + whole, carry_n_);
  return true;
}

size_t Landing::next_read(size_t cap) const {
  if (cipher_) return room();
  return sink_ ? std::min(left_, cap - carry_n_) : left_;
}

size_t Landing::wake_bytes(size_t batch) const {
  if (!cipher_) return std::min(left_, batch);
  const size_t last = records_of(n_) > 0 ? (records_of(n_) - 1) * kWireRecord : 0;  // its first wire byte
  return std::min(pos_ < last ? last - pos_ : wire_n_ - pos_, batch);
}

ssize_t Landing::recv_from(int fd, int flags, uint8_t* stage, size_t cap) {
  if (cipher_) {
    // One read scatters up to kSlots records' ciphertext and tags into their places.
    iovec iov[2 * kSlots + 2];
    int cnt = 0;
    const size_t save = pos_;
    for (size_t want = room(); want > 0 && cnt < static_cast<int>(sizeof(iov) / sizeof(iov[0]));) {
      size_t len = 0;
      uint8_t* to = target(&len);
      len = std::min(len, want);
      iov[cnt++] = {to, len};
      pos_ += len;
      want -= len;
    }
    pos_ = save;
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = cnt;
    ssize_t r = ::recvmsg(fd, &msg, flags);
    if (r <= 0) return r;
    pos_ += static_cast<size_t>(r);
    bool authentic;
    try {
      authentic = open_ready();
    } catch (const Error&) {
      // Keys used up or libcrypto failing: never a peer's doing, and a receive thread
      // must not throw; the owner fails the link with this errno.
      errno = EPROTO;
      return -1;
    }
    if (!authentic) {
      errno = EBADMSG;
      return -1;
    }
    return r;
  }
  if (!sink_) {
    ssize_t r = ::recv(fd, dst_, left_, flags);
    if (r > 0) {
      dst_ += r;
      left_ -= static_cast<size_t>(r);
    }
    return r;
  }
  // The split unit's first bytes go in front, so the stage holds whole units from its
  // start and goes to the sink in one call.
  std::memcpy(stage, carry_, carry_n_);
  ssize_t r = ::recv(fd, stage + carry_n_, next_read(cap), flags);
  if (r <= 0) return r;
  left_ -= static_cast<size_t>(r);
  const size_t have = carry_n_ + static_cast<size_t>(r);
  const size_t whole = have - have % unit_;
  if (whole) sink_->consume(stage, dst_, whole);
  dst_ += whole;
  carry_n_ = have - whole;
  std::memcpy(carry_, stage + whole, carry_n_);
  return r;
}

// ---------------------------------------------------------------- sealed payloads

uint8_t* Landing::target(size_t* len) {
  const size_t i = pos_ / kWireRecord;
  const size_t off = pos_ - i * kWireRecord;
  const size_t rl = record_len(n_, i);
  if (off < rl) {
    *len = rl - off;
    return slots_.get() + (i % kSlots) * kRecordBytes + off;
  }
  *len = rl + kTagBytes - off;
  return tags_[i % kSlots] + (off - rl);
}

size_t Landing::room() const {
  if (pos_ == wire_n_) return 0;
  // Records opened_ .. opened_ + kSlots - 1 have a slot (and a tag slot) each.
  const size_t last = std::min(opened_ + kSlots, records_of(n_)) - 1;
  const size_t end = last * kWireRecord + record_len(n_, last) + kTagBytes;
  return end - pos_;
}

bool Landing::open_ready() {
  const size_t records = records_of(n_);
  while (opened_ < records) {
    const size_t i = opened_;
    const size_t rl = record_len(n_, i);
    if (pos_ < i * kWireRecord + rl + kTagBytes) break;
    // Opened in its slot, so a forged record's bytes (kAead: decrypted under a wrong tag;
    // kMac: as sent) never reach the destination, which holds what it held before.
    uint8_t* data = slots_.get() + (i % kSlots) * kRecordBytes;
    if (!cipher_->open(stream_, aad_, aad_n_, data, rl, tags_[i % kSlots])) return false;
    if (sink_ && rl) {
      sink_->consume(data, base_ + i * kRecordBytes, rl);
    } else if (rl) {
      std::memcpy(base_ + i * kRecordBytes, data, rl);
    }
    ++opened_;
  }
  return true;
}

}  // namespace mccl
