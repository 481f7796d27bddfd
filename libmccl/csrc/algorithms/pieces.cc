#include "algorithms/pieces.h"

#include <algorithm>
#include <string>

#include "core/errors.h"

namespace mccl {

namespace {

// How long one wait for the producer sleeps before it looks at the links again.
constexpr auto kReadySlice = std::chrono::milliseconds(10);
// While pieces wait for their input and messages are in flight, the links are polled in
// slices this long between two looks at the ready ticket (a producer in another process
// cannot wake poll()).
constexpr auto kProducerPoll = std::chrono::milliseconds(2);
// A ring message is 1/N of a piece. Where the op is large enough pieces grow until it is
// this large: its stripes (two sockets) are then handed to the send thread and the receive
// threads (transport/pair.h, recv_thread.h). At 8 hosts, 2 MB pieces made 256K messages,
// 128K stripes that the thread running the ring wrote, read and reduced all by itself.
constexpr size_t kMessageBytes = 1 << 20;
// ... but pieces stay at most this fraction of the buffer: the producer's first piece and
// the consumer's last are what the pipeline cannot hide.
constexpr size_t kMinPieces = 16;

}  // namespace

Pieces Pieces::cut(size_t count, size_t elem, size_t pipeline_bytes, int ranks) {
  Pieces p;
  p.count = count;
  p.elem = elem;
  const size_t n_ranks = static_cast<size_t>(std::max(ranks, 1));
  const size_t e = std::max<size_t>(elem, 1);
  const size_t grown = std::min(kMessageBytes * n_ranks, count * e / kMinPieces);
  p.piece_elems = std::max(std::max(pipeline_bytes, grown) / e, n_ranks);
  // The ring's tags are u32 = step * pieces + piece: keep the pieces well inside that.
  const size_t max_pieces = std::max<size_t>(1, (size_t(1) << 30) / (2 * n_ranks));
  p.piece_elems = std::max(p.piece_elems, (count + max_pieces - 1) / max_pieces);
  p.n = count == 0 ? 0 : (count + p.piece_elems - 1) / p.piece_elems;
  return p;
}

Pieces Pieces::split(size_t count, size_t elem, size_t parts) {
  Pieces p;
  p.count = count;
  p.elem = elem;
  p.n = count == 0 ? 0 : std::clamp<size_t>(parts, 1, count);
  p.piece_elems = p.n == 0 ? 1 : part_len(count, p.n, 0);  // the largest
  p.balanced = true;
  return p;
}

PieceGate::PieceGate(Collective& c, const OpTickets& t, const Pieces& p, const char* op)
    : c_(c), t_(t), p_(p), op_(op), finished_(p.n, false) {}

bool PieceGate::ready(size_t j) const {
  if (!t_.ready) return true;
  const uint64_t v = t_.ready->value();
  if (v == Ticket::kPoison) {
    throw_error(ErrorKind::kAborted,
                std::string("[") + op_ + "] the producer of this rank's buffer poisoned its ready "
                "ticket (it failed or aborted) before piece " + std::to_string(j + 1) + " of " +
                std::to_string(p_.n) + " was ready; see the producer's error");
  }
  return v >= target(j);
}

void PieceGate::check_deadline(size_t j) const {
  if (Clock::now() < c_.deadline) return;
  throw_error(ErrorKind::kTimeout,
              std::string("Timed out after ") + format_seconds(c_.timeout_s) + " s: [" + op_ +
                  "] waited for this rank's input, piece " + std::to_string(j + 1) + " of " +
                  std::to_string(p_.n) + " (ready ticket at " + std::to_string(t_.ready->value()) +
                  ", needs " + std::to_string(target(j)) +
                  "); likely cause: the producer of this buffer (the client copying it in, or "
                  "the GPU) stalled; check it, or raise the process group timeout");
}

void PieceGate::wait_ready(size_t j) {
  while (!ready(j)) {
    check_deadline(j);
    t_.ready->wait_until(target(j), std::min(c_.deadline, Clock::now() + kReadySlice));
    c_.t.progress(Clock::now());  // surfaces an abort or a lost peer; buffers early data
  }
}

RequestPtr PieceGate::next_or_ready(size_t j, size_t outstanding) {
  if (outstanding == 0) {
    wait_ready(j);
    return nullptr;
  }
  RequestPtr req = c_.next_until(Clock::now() + kProducerPoll);
  if (!req) check_deadline(j);
  return req;
}

void PieceGate::finished(size_t j) {
  if (finalize) finalize(p_.begin(j), p_.len(j));
  finished_[j] = true;
  size_t k = next_done_;
  while (k < p_.n && finished_[k]) ++k;
  if (k == next_done_) return;
  next_done_ = k;
  if (t_.done) t_.done->signal(target(k - 1));
}

}  // namespace mccl
