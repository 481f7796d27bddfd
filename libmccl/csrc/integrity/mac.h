// Per-frame message authentication for link sockets (issue 11, "Integrity"): ChaCha20's
// block function derives a fresh one-time Poly1305 key for every frame from a link key and
// the frame's number, and Poly1305 tags the frame's header and payload (RFC 8439's
// construction without the encryption: the data stays readable, but a LAN host that did
// not take part in the handshake can neither forge nor alter a frame undetected).
//
// Self-contained, portable C++ (64-bit limbs with unsigned __int128); checked against
// RFC 8439's test vectors (tests/test_frame_mac.py). The transport tags every frame with it
// when its owner gives a link keys (transport/pair.h; derived by the link handshake, MCCL_WIRE_SECURITY).
#pragma once
#include <cstddef>
#include <cstdint>

#include "integrity/keys.h"

namespace mccl {

constexpr size_t kMacTagBytes = 16;

// RFC 8439 2.3: one 64-byte ChaCha20 block of `key` (32 bytes), `counter` and `nonce` (12 bytes).
void chacha20_block(const uint8_t key[32], uint32_t counter, const uint8_t nonce[12], uint8_t out[64]);

// RFC 8439 2.5: Poly1305 over a message given in pieces; a one-time key per message.
class Poly1305 {
 public:
  explicit Poly1305(const uint8_t key[32]);
  void update(const uint8_t* m, size_t n);
  void finish(uint8_t tag[kMacTagBytes]);

 private:
  void blocks(const uint8_t* m, size_t n, uint64_t hibit);
  uint64_t r_[3], h_[3] = {0, 0, 0}, pad_[2];
  uint8_t buf_[16];
  size_t have_ = 0;
};


// Frames of one direction of a socket are numbered per stream: data frames in the order
// they are queued, control frames (ABORT, BYE), which jump the queue, apart.
enum class MacStream : uint32_t { kData = 0, kControl = 1 };

// A Poly1305 ready for frame `frame_no` of `stream` under `link_key` (its one-time key is
// chacha20_block(link_key, 0, {stream, frame_no})); the receiver feeds it as bytes arrive.
Poly1305 frame_mac(const uint8_t link_key[kMacKeyBytes], uint32_t stream, uint64_t frame_no);

// The tag of one frame: Poly1305 keyed by chacha20_block(link_key, 0, {stream, frame_no}),
// over header then payload. `stream` tells the directions and sockets of a link apart, so
// no two frames under one link key share a one-time key.
void frame_tag(const uint8_t link_key[kMacKeyBytes], uint32_t stream, uint64_t frame_no, const uint8_t* header,
               size_t header_bytes, const uint8_t* payload, size_t payload_bytes, uint8_t tag[kMacTagBytes]);

// Constant-time comparison of two tags.
bool tags_equal(const uint8_t a[kMacTagBytes], const uint8_t b[kMacTagBytes]);

}  // namespace mccl
