// What a receive does with its payload when the bytes are not simply stored: they are
// handed to the receive's Sink, which the layer above supplies. The transport moves bytes
// and never learns what they mean (gloo's transport/ and NCCL's ncclNet_t draw the same
// line); the algorithms' reduce-receive is a sink that folds what arrives into the
// destination (algorithms/reduce_sink.h).
//
// The sink is called once per chunk the transport has in hand (a read, a record), never
// per byte, and straight from where the bytes are: the socket's staging buffer, a receive
// thread's stage, an opened record's slot. No extra copy is made for it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mccl {

class Sink {
 public:
  // A split unit's first bytes wait in a carry of this size inside the transport.
  static constexpr size_t kMaxUnit = 16;

  virtual ~Sink() = default;
  // The sink only ever sees whole units of this many bytes (1 .. kMaxUnit), at
  // unit-aligned positions of the receive: whoever sends must cut frames at unit
  // boundaries, and the transport keeps the bytes of a unit split between two reads.
  virtual size_t unit() const = 0;
  // n bytes (whole units) at src, which arrived for dst .. dst + n of the receive's
  // buffer. src may have any alignment and is only valid during the call.
  virtual void consume(const uint8_t* src, uint8_t* dst, size_t n) const = 0;
};

}  // namespace mccl
