#include "integrity/mac.h"

#include <cstring>

namespace mccl {
namespace {

uint32_t le32(const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }
uint64_t le64(const uint8_t* p) { return uint64_t(le32(p)) | uint64_t(le32(p + 4)) << 32; }
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint32_t rotl(uint32_t v, int c) { return (v << c) | (v >> (32 - c)); }

void quarter(uint32_t* x, int a, int b, int c, int d) {
  x[a] += x[b]; x[d] = rotl(x[d] ^ x[a], 16);
  x[c] += x[d]; x[b] = rotl(x[b] ^ x[c], 12);
  x[a] += x[b]; x[d] = rotl(x[d] ^ x[a], 8);
  x[c] += x[d]; x[b] = rotl(x[b] ^ x[c], 7);
}

constexpr uint64_t kMask44 = (uint64_t(1) << 44) - 1;
constexpr uint64_t kMask42 = (uint64_t(1) << 42) - 1;
using u128 = unsigned __int128;

}  // namespace

void chacha20_block(const uint8_t key[32], uint32_t counter, const uint8_t nonce[12], uint8_t out[64]) {
  uint32_t s[16] = {0x61707865, 0x3320646e, 0x79622d32, 0x6b206574};  // "expand 32-byte k"
  for (int i = 0; i < 8; ++i) s[4 + i] = le32(key + 4 * i);
  s[12] = counter;
  for (int i = 0; i < 3; ++i) s[13 + i] = le32(nonce + 4 * i);
  uint32_t x[16];
  std::memcpy(x, s, sizeof x);
  for (int i = 0; i < 10; ++i) {
    quarter(x, 0, 4, 8, 12); quarter(x, 1, 5, 9, 13); quarter(x, 2, 6, 10, 14); quarter(x, 3, 7, 11, 15);
    quarter(x, 0, 5, 10, 15); quarter(x, 1, 6, 11, 12); quarter(x, 2, 7, 8, 13); quarter(x, 3, 4, 9, 14);
  }
  for (int i = 0; i < 16; ++i) put32(out + 4 * i, x[i] + s[i]);
}

// Poly1305 in three 44/44/42-bit limbs: products fit 128 bits with room for the carries.
Poly1305::Poly1305(const uint8_t key[32]) {
  uint64_t t0 = le64(key), t1 = le64(key + 8);
  // r is clamped as RFC 8439 2.5 says (the bit masks below are that clamp, spread over limbs).
  r_[0] = t0 & 0xffc0fffffffULL;
  r_[1] = ((t0 >> 44) | (t1 << 20)) & 0xfffffc0ffffULL;
  r_[2] = (t1 >> 24) & 0x00ffffffc0fULL;
  pad_[0] = le64(key + 16);
  pad_[1] = le64(key + 24);
}

void Poly1305::blocks(const uint8_t* m, size_t n, uint64_t hibit) {
  const uint64_t r0 = r_[0], r1 = r_[1], r2 = r_[2];
  const uint64_t s1 = r1 * (5 << 2), s2 = r2 * (5 << 2);
  uint64_t h0 = h_[0], h1 = h_[1], h2 = h_[2];
  while (n >= 16) {
    uint64_t t0 = le64(m), t1 = le64(m + 8);
    h0 += t0 & kMask44;
    h1 += ((t0 >> 44) | (t1 << 20)) & kMask44;
    h2 += ((t1 >> 24) & kMask42) | hibit;
    u128 d0 = u128(h0) * r0 + u128(h1) * s2 + u128(h2) * s1;
    u128 d1 = u128(h0) * r1 + u128(h1) * r0 + u128(h2) * s2;
    u128 d2 = u128(h0) * r2 + u128(h1) * r1 + u128(h2) * r0;
    uint64_t c = uint64_t(d0 >> 44);
    h0 = uint64_t(d0) & kMask44;
    d1 += c;
    c = uint64_t(d1 >> 44);
    h1 = uint64_t(d1) & kMask44;
    d2 += c;
    c = uint64_t(d2 >> 42);
    h2 = uint64_t(d2) & kMask42;
    h0 += c * 5;
    c = h0 >> 44;
    h0 &= kMask44;
    h1 += c;
    m += 16;
    n -= 16;
  }
  h_[0] = h0, h_[1] = h1, h_[2] = h2;
}

void Poly1305::update(const uint8_t* m, size_t n) {
  const uint64_t hibit = uint64_t(1) << 40;  // the 2^128 bit of a full block, in limb 2
  if (have_) {
    size_t take = 16 - have_ < n ? 16 - have_ : n;
    std::memcpy(buf_ + have_, m, take);
    have_ += take, m += take, n -= take;
    if (have_ < 16) return;
    blocks(buf_, 16, hibit);
    have_ = 0;
  }
  size_t whole = n & ~size_t(15);
  blocks(m, whole, hibit);
  std::memcpy(buf_, m + whole, n - whole);
  have_ = n - whole;
}

void Poly1305::finish(uint8_t tag[kMacTagBytes]) {
  if (have_) {
    buf_[have_] = 1;  // a short last block carries its 2^(8*len) bit in the bytes themselves
    std::memset(buf_ + have_ + 1, 0, 16 - have_ - 1);
    blocks(buf_, 16, 0);
  }
  uint64_t h0 = h_[0], h1 = h_[1], h2 = h_[2], c;
  c = h1 >> 44; h1 &= kMask44; h2 += c;
  c = h2 >> 42; h2 &= kMask42; h0 += c * 5;
  c = h0 >> 44; h0 &= kMask44; h1 += c;
  c = h1 >> 44; h1 &= kMask44; h2 += c;
  c = h2 >> 42; h2 &= kMask42; h0 += c * 5;
  c = h0 >> 44; h0 &= kMask44; h1 += c;
  // h mod p: subtract p = 2^130 - 5 if h >= p, without branching on secret data.
  uint64_t g0 = h0 + 5; c = g0 >> 44; g0 &= kMask44;
  uint64_t g1 = h1 + c; c = g1 >> 44; g1 &= kMask44;
  uint64_t g2 = h2 + c - (uint64_t(1) << 42);
  c = (g2 >> 63) - 1;  // all ones when h >= p
  g0 &= c, g1 &= c, g2 &= c;
  c = ~c;
  h0 = (h0 & c) | g0, h1 = (h1 & c) | g1, h2 = (h2 & c) | g2;
  // + s, mod 2^128
  uint64_t t0 = pad_[0], t1 = pad_[1];
  h0 += t0 & kMask44; c = h0 >> 44; h0 &= kMask44;
  h1 += (((t0 >> 44) | (t1 << 20)) & kMask44) + c; c = h1 >> 44; h1 &= kMask44;
  h2 += ((t1 >> 24) & kMask42) + c; h2 &= kMask42;
  put64(tag, h0 | (h1 << 44));
  put64(tag + 8, (h1 >> 20) | (h2 << 24));
}

Poly1305 frame_mac(const uint8_t link_key[kMacKeyBytes], uint32_t stream, uint64_t frame_no) {
  uint8_t nonce[12], block[64];
  put32(nonce, stream);
  put64(nonce + 4, frame_no);
  chacha20_block(link_key, 0, nonce, block);
  return Poly1305(block);  // the first 32 bytes: RFC 8439 2.6's one-time key
}

void frame_tag(const uint8_t link_key[kMacKeyBytes], uint32_t stream, uint64_t frame_no, const uint8_t* header,
               size_t header_bytes, const uint8_t* payload, size_t payload_bytes, uint8_t tag[kMacTagBytes]) {
  Poly1305 mac = frame_mac(link_key, stream, frame_no);
  mac.update(header, header_bytes);
  mac.update(payload, payload_bytes);
  mac.finish(tag);
}

bool tags_equal(const uint8_t a[kMacTagBytes], const uint8_t b[kMacTagBytes]) {
  uint8_t d = 0;
  for (size_t i = 0; i < kMacTagBytes; ++i) d |= uint8_t(a[i] ^ b[i]);
  return d == 0;
}

}  // namespace mccl
