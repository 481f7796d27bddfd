// Where one frame's payload goes while it is read off a socket: copied into place, or
// handed to the receive's sink (sink.h) with its place. The ring's reduce-scatter uses
// the latter: what arrives from the left is added into the buffer while it is still hot
// in cache, instead of landing in scratch memory that the algorithm then reads back, and
// the thread that reads the socket does that share of the work.
//
// recv() returns arbitrary byte counts, so a sink's unit can be split between two reads;
// the sink only ever sees whole units, and the bytes of a split one wait in a small
// carry until the rest arrives.
//
// Sealed frames (integrity/aead.h) arrive as records, each followed by its tag. A record
// is read into a slot of this landing's own stage, opened there, and only then copied
// into place or handed to the sink: no byte of a record reaches the destination (a
// user's tensor, or the shared segment a daemon's client reads) or is counted before its
// tag matched, so a forged record leaves the destination as it was. The extra copy is
// from a slot still hot in cache. Records hold whole units (kRecordBytes and every
// frame's range are multiples of the unit), so sealed payloads need no carry.
#pragma once
#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "integrity/aead.h"
#include "transport/sink.h"

namespace mccl {

class Landing {
 public:
  // n payload bytes go to dst; sink null copies, else the sink consumes them with dst as
  // their place (n and dst's position must then be whole units of the sink; it must stay
  // alive until the payload is in).
  void start(uint8_t* dst, size_t n, const Sink* sink = nullptr);
  // Right after start(): the payload comes sealed, opened with `cipher` as records of
  // `stream` under `aad` (the frame's header; the caller keeps it until the payload is in).
  void unseal(RecordCipher* cipher, RecordStream stream, const uint8_t* aad, size_t aad_n);
  // Wire bytes not yet taken (payload, plus tags when sealed).
  size_t left() const { return cipher_ ? wire_n_ - pos_ : left_; }

  // Takes n <= left() wire bytes from src (any alignment). False: a record failed
  // authentication (the frame must be dropped with the link).
  bool put(const uint8_t* src, size_t n);
  // One recv(fd, flags) of at most next_read(cap) bytes: a copy reads straight into place,
  // a sink's payload is read into `stage` (cap bytes; sealed: its own stage) and handed
  // to it from there.
  // Returns what recv() returned (bytes taken, 0 at EOF, -1 with errno set; errno
  // EBADMSG: a record failed authentication; EPROTO: it could not be opened here).
  ssize_t recv_from(int fd, int flags, uint8_t* stage, size_t cap);
  // The most bytes the next recv_from(..., cap) asks for: a shorter read drained the socket.
  size_t next_read(size_t cap) const;
  // How many bytes a reader waiting for this payload should let arrive before it wakes,
  // given it would like at most `batch`: sealed, the last record is left for a wake of its
  // own, so the records before it are opened while it arrives and only its own opening
  // follows the payload's last byte.
  size_t wake_bytes(size_t batch) const;

 private:
  // Sealed records in flight at once: a read may take this many records' bytes.
  static constexpr size_t kSlots = 4;
  static constexpr size_t kWireRecord = kRecordBytes + kTagBytes;

  // Sealed: where wire byte pos_ goes, and how many contiguous bytes go there.
  uint8_t* target(size_t* len);
  // Sealed: the most wire bytes that may be taken before the next record is opened.
  size_t room() const;
  // Sealed: opens (and hands to the sink) every record whose bytes are all in. False: one failed.
  bool open_ready();

  uint8_t* dst_ = nullptr;  // copy: the next byte; sink: the next whole unit's place
  size_t left_ = 0;         // payload bytes not yet taken
  const Sink* sink_ = nullptr;
  size_t unit_ = 1;
  alignas(16) uint8_t carry_[Sink::kMaxUnit];  // the first bytes of a split unit
  size_t carry_n_ = 0;

  RecordCipher* cipher_ = nullptr;  // null: plain payload
  RecordStream stream_ = RecordStream::kData;
  const uint8_t* aad_ = nullptr;
  size_t aad_n_ = 0;
  uint8_t* base_ = nullptr;  // the payload's first byte in the destination
  size_t n_ = 0;             // payload bytes
  size_t wire_n_ = 0;        // sealed_bytes(n_)
  size_t pos_ = 0;           // wire bytes taken
  size_t opened_ = 0;        // records opened
  uint8_t tags_[kSlots][kTagBytes];
  std::unique_ptr<uint8_t[]> slots_;  // kSlots records' ciphertext, opened in place
};

}  // namespace mccl
