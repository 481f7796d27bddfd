// The link's sealing (integrity/aead.h): data frames a few records ahead of the socket,
// by whichever thread writes it, and control frames whole, as they are written.
#include <algorithm>
#include <cstring>

#include "transport/pair.h"

namespace mccl {

uint8_t* Pair::stage_slot(SendItem& it, size_t record) const {
  // A frame of one record has a stage of its own size; longer ones a pooled ring.
  return it.stage.get() + (record_len(it.length, 0) == it.length ? 0 : (record % kSealAhead) * kRecordBytes);
}

int Pair::claim_seal(size_t conn, SealJob* jobs) {
  if (!sealed_) return 0;
  Conn& c = conns_[conn];
  int n = 0;
  for (auto it = c.sendq.begin(); it != c.sendq.end() && n < kMaxSealJobs; ++it) {
    const size_t units = records_of(it->length) + 1;
    // Record i may be sealed once record i - kSealAhead has gone out (its slot is free).
    const size_t records_out = it->sent / (kRecordBytes + kTagBytes);
    size_t limit = std::min(units, records_out + kSealAhead + 1);
    // The queue's first frame with nothing sealed left to write: the socket may idle until
    // this pass's records are sealed, so seal one record and write it first (a ring step's
    // first bytes wait for 64 KiB of sealing, not kSealAhead x 64 KiB), then twice as many
    // as went out so far, up to kSealAhead, while the kernel sends them. Frames behind it
    // are sealed while it goes out.
    if (it == c.sendq.begin() && it->sealed <= records_out + 1) {
      limit = std::min(limit, std::max<size_t>(it->sealed, 1) + std::max<size_t>(records_out, 1));
    }
    if (it->sealed < limit) {
      if (!it->stage && it->length && c.sealer->encrypts()) {
        if (records_of(it->length) == 1) {
          it->stage.reset(new uint8_t[it->length]);
        } else if (!c.spare_stages.empty()) {
          it->stage = std::move(c.spare_stages.back());
          c.spare_stages.pop_back();
        } else {
          it->stage.reset(new uint8_t[kSealAhead * kRecordBytes]);
        }
      }
      jobs[n++] = {conn, &*it, it->sealed, limit};
    }
    if (limit < units) break;  // what follows this frame cannot go out before it anyway
  }
  return n;
}

void Pair::seal(const SealJob* jobs, int n) {
  for (int j = 0; j < n; ++j) {
    seal_units(conns_[jobs[j].conn], *static_cast<SendItem*>(jobs[j].item), jobs[j].from, jobs[j].to);
  }
}

void Pair::commit_seal(const SealJob* jobs, int n) {
  for (int j = 0; j < n; ++j) static_cast<SendItem*>(jobs[j].item)->sealed = jobs[j].to;
}

void Pair::seal_units(Conn& c, SendItem& it, size_t from, size_t to) {
  const auto stream = it.req ? RecordStream::kData : RecordStream::kControl;
  for (size_t u = from; u < to; ++u) {
    if (u == 0) {
      c.sealer->seal(stream, it.header, kFrameHeaderBytes, nullptr, nullptr, 0, it.header + kFrameHeaderBytes);
      continue;
    }
    const size_t i = u - 1;
    const uint8_t* plain = it.payload + i * kRecordBytes;
    uint8_t* out = c.sealer->encrypts() ? stage_slot(it, i) : nullptr;
    c.sealer->seal(stream, it.header, kFrameHeaderBytes, plain, out, record_len(it.length, i),
                   it.tags[i % kSealAhead]);
  }
}

std::string Pair::control_frame(Conn& c, const FrameHeader& h, const std::string& payload) {
  if (!sealed_) {
    std::string bytes(kFrameHeaderBytes + payload.size(), '\0');
    encode_header(h, reinterpret_cast<uint8_t*>(&bytes[0]));
    std::copy(payload.begin(), payload.end(), bytes.begin() + kFrameHeaderBytes);
    return bytes;
  }
  // Control payloads (an ABORT's report) fit one record: header, its tag, record, tag.
  std::string bytes(kFrameHeaderBytes + kTagBytes + sealed_bytes(payload.size()), '\0');
  auto* p = reinterpret_cast<uint8_t*>(&bytes[0]);
  encode_header(h, p);
  c.sealer->seal(RecordStream::kControl, p, kFrameHeaderBytes, nullptr, nullptr, 0, p + kFrameHeaderBytes);
  uint8_t* body = p + kFrameHeaderBytes + kTagBytes;
  for (size_t i = 0; i < records_of(payload.size()); ++i) {
    const size_t rl = record_len(payload.size(), i);
    uint8_t* rec = body + i * (kRecordBytes + kTagBytes);
    std::memcpy(rec, payload.data() + i * kRecordBytes, rl);
    c.sealer->seal(RecordStream::kControl, p, kFrameHeaderBytes, rec, rec, rl, rec + rl);
  }
  return bytes;
}

}  // namespace mccl
