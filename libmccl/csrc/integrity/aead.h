// Sealing of a link socket's frames (issue 24): AES-256-GCM from OpenSSL 3's libcrypto.
//
// A frame's header is followed by its own tag (an empty record with the header as
// associated data), so a receiver acts on no header field before it is authentic. Its
// payload follows as records of at most kRecordBytes, each followed by its 16-byte tag.
// Every record is sealed under its socket direction's key (integrity/keys.h) with a
// 96-bit nonce of (stream, record number) and the frame's header as associated data. So
// a record that is altered, injected, dropped, replayed or moved to another frame, socket
// or direction fails its tag, and a receiver verifies each record before any of its
// bytes is used.
//
// kAead encrypts the record; kMac leaves it readable and authenticates it as associated
// data (GMAC: the same GHASH tag, no keystream).
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/options.h"
#include "integrity/keys.h"

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;  // <openssl/evp.h>

namespace mccl {

constexpr size_t kRecordBytes = 64 << 10;
constexpr size_t kTagBytes = 16;

// Records of one direction of a socket are numbered per stream: data frames in the order
// they go out, control frames (ABORT, BYE), which jump the queue, apart.
enum class RecordStream : uint32_t { kData = 0, kControl = 1 };

// Records and wire bytes (records and their tags) of n payload bytes.
inline size_t records_of(size_t n) { return (n + kRecordBytes - 1) / kRecordBytes; }
inline size_t sealed_bytes(size_t n) { return n + records_of(n) * kTagBytes; }
// Payload bytes of record i of a payload of n bytes.
inline size_t record_len(size_t n, size_t i) {
  const size_t begin = i * kRecordBytes;
  return n - begin < kRecordBytes ? n - begin : kRecordBytes;
}

// One direction of one socket: seals what this side sends, or opens what the peer sent,
// numbering the records itself. Not thread-safe: one thread at a time (the one that
// owns the socket's sending or receiving at that moment).
class RecordCipher {
 public:
  // Records one key may seal: 2^36 x 64 KiB (2^52 bytes) keeps AES-GCM's distinguishing
  // advantage near 2^-32. Keys are fresh per handshake, so in practice this never binds.
  static constexpr uint64_t kMaxRecords = uint64_t(1) << 36;

  // mode: kMac or kAead; key: this direction's 32-byte key; seals: this side sends.
  RecordCipher(WireSecurity mode, const uint8_t key[kMacKeyBytes], bool seals);
  ~RecordCipher();
  RecordCipher(const RecordCipher&) = delete;
  RecordCipher& operator=(const RecordCipher&) = delete;

  WireSecurity mode() const { return mode_; }
  bool encrypts() const { return mode_ == WireSecurity::kAead; }

  // Seals the next record of `stream`: kAead writes the ciphertext of in[0, n) to out
  // (out == in allowed), kMac writes nothing there; both write the tag over aad and the
  // record. Throws ProtocolError once the stream's record numbers are used up.
  void seal(RecordStream stream, const uint8_t* aad, size_t aad_n, const uint8_t* in, uint8_t* out,
            size_t n, uint8_t tag[kTagBytes]);
  // Opens the next record of `stream` in place (kAead decrypts data[0, n)). False: the tag
  // does not match (the record was altered, injected, replayed, reordered, or sealed under
  // another key); then data holds no usable bytes.
  bool open(RecordStream stream, const uint8_t* aad, size_t aad_n, uint8_t* data, size_t n,
            const uint8_t tag[kTagBytes]);

 private:
  void start(RecordStream stream);

  const WireSecurity mode_;
  EVP_CIPHER_CTX* ctx_ = nullptr;
  uint64_t next_[2] = {0, 0};  // record numbers per stream
};

}  // namespace mccl
