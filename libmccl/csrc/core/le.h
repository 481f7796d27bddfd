// Little-endian fields, byte by byte: how every wire format of the engine (frame header,
// collective signatures, handshake terms) encodes integers, so that peers agree whatever
// their compiler's struct padding and byte order. `p` advances past the field.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mccl {

template <typename T>
inline void put_le(uint8_t*& p, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) *p++ = static_cast<uint8_t>(uint64_t(v) >> (8 * i));
}

template <typename T>
inline T get_le(const uint8_t*& p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t(*p++) << (8 * i);
  return static_cast<T>(v);
}

}  // namespace mccl
