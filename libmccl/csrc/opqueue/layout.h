// The shared-memory layout of one client's small-op queue to mccld (docs/daemon-fastpath.md).
//
// One queue per attached client, one op in flight: the client copies an op's input into
// the data area, fills the entry and raises `submitted` by one; mccld's dispatcher
// (dispatcher.h) serves it, writes the result into the data area and raises `completed`
// to the same count. Both counters are segment tickets (ticket.h), so each side sleeps on
// a futex and a failure poisons them. The client owns the entry and the data until it
// publishes, the daemon from then until it completes. Everything mccld reads here is
// untrusted: it copies the entry out once and checks every field against its own copy of
// the sizes, which came through the control channel and the mapping's real size.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mccl::opqueue {

constexpr size_t kSubmittedOff = 0;   // ticket: ops the client published
constexpr size_t kCompletedOff = 64;  // ticket: ops mccld finished; poisoned when the job fails
constexpr size_t kErrorOff = 128;     // ErrorRecord, written before `completed` is poisoned
constexpr size_t kEntryOff = 3072;    // Entry of the op in flight
constexpr size_t kDataOff = 4096;     // its data (page-aligned), slot_bytes long
constexpr size_t kErrorMsgMax = 2048;
constexpr size_t kMaxSlotBytes = size_t{16} << 20;
// Error kinds an ErrorRecord may carry: mccl::ErrorKind's, then mccl_common/errors.py's Python-only
// ones (7: DaemonUnavailableError, 8: AuthError), which only travel through to Python.
constexpr int32_t kLastKind = 8;

enum class Kind : uint32_t { kAllreduce = 1, kBarrier = 2 };

struct Entry {
  uint64_t seq;    // the op's place in the job's collective order (shared with the slow path)
  uint32_t kind;   // Kind
  uint32_t dtype;  // mccl::DType
  uint32_t op;     // mccl::ReduceOp
  uint32_t reserved;
  uint64_t count;  // elements
};

struct ErrorRecord {
  // `completed` as it stood before the poison hid it: a client whose op is at or below it
  // takes the result, which is final, instead of the job's error (a peer may die right
  // after the op it shared with this client finished, before this client looked).
  uint64_t completed;
  int32_t kind;       // mccl::ErrorKind
  int32_t peer_rank;
  uint32_t msg_len;   // bytes of msg used
  uint32_t addr_len;  // bytes of peer_addr used
  char peer_addr[256];
  char msg[kErrorMsgMax];
};

static_assert(kErrorOff + sizeof(ErrorRecord) <= kEntryOff, "error record overlaps the entry");
static_assert(kEntryOff + sizeof(Entry) <= kDataOff, "entry overlaps the data");

inline size_t queue_bytes(size_t slot_bytes) { return kDataOff + slot_bytes; }

}  // namespace mccl::opqueue
