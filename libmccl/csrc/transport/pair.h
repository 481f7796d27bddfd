// The link to one peer: K sockets, their send queues and frame parsers, and the
// tables that match incoming frames with posted receives.
//
// Sends are zero-copy (sendmsg of [header, payload] straight from the caller's buffer);
// messages of at least kStripeBytes are split into K stripes, one per socket, each
// with its own header and offset (a multiple of kStripeAlign, so a stripe holds whole
// units of any sink). Receives read the header, look the key up among the posted
// receives and then read the payload straight into the posted buffer at the frame's
// offset, or hand it to the receive's sink (sink.h, landing.h); a large payload is read
// by a receive thread, if any (recv_thread.h). A frame nobody waits for yet is
// "unexpected": it is read into a buffer of the message's size (bounded by the
// transport) and copied (or handed to the sink) when the receive is posted.
//
// Given keys (one FrameKeys per socket) and a wire security mode, every frame is sealed
// (integrity/aead.h): its header carries a tag, and its payload goes as records, each with
// a tag, encrypted in kAead mode. The thread that writes a frame seals it, a few records
// ahead of the socket, from the caller's buffer into a per-frame stage (kMac: the payload
// still goes out zero-copy, only the tags are staged). The receiver checks the header's
// tag before it acts on any field and opens each record before its bytes are copied out,
// handed to a sink or counted (landing.h); a failed tag fails the communicator with AuthError.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/options.h"
#include "integrity/aead.h"
#include "transport/frame.h"
#include "transport/landing.h"
#include "transport/recv_thread.h"
#include "transport/request.h"
#include "transport/send_thread.h"
#include "transport/socket.h"

struct iovec;  // <sys/uio.h>

namespace mccl {

class Pair;

// What a pair needs from the transport that owns it.
class PairHost {
 public:
  virtual ~PairHost() = default;
  virtual void request_done(const RequestPtr& req) = 0;
  // Called on the first frame of each collective message; throws CollectiveMismatch.
  virtual void check_collective_frame(Pair& pair, const FrameHeader& h) = 0;
  // A p2p frame without a posted receive: may hand it to a waiting any-source receive.
  virtual RequestPtr claim_for_any_source(Pair& pair, const FrameHeader& h) = 0;
  // A buffer for an unexpected message of h.total bytes; throws when over the cap.
  virtual std::unique_ptr<uint8_t[]> reserve_unexpected(Pair& pair, const FrameHeader& h,
                                                        size_t* capacity) = 0;
  // Gives it back once copied out (or dropped); the host may keep it for reuse.
  virtual void release_unexpected(std::unique_ptr<uint8_t[]> buf, size_t capacity,
                                  size_t bytes) = 0;
  // Transport-wide arrival stamp: any-source receives take the earliest message.
  virtual uint64_t next_arrival() = 0;
  // The name of the op a collective signature belongs to, for messages.
  virtual std::string op_name(const Signature& sig) const = 0;
};

// An ABORT frame from a peer, as an error: the kind and blamed peer of the original
// failure, plus who reported it so the transport can forward it unchanged.
class RemoteAbort : public Error {
 public:
  RemoteAbort(ErrorKind kind, const std::string& msg, int lost_rank, std::string lost_addr,
              int origin, std::string original_message)
      : Error(kind, msg, lost_rank, std::move(lost_addr)),
        origin_(origin),
        original_message_(std::move(original_message)) {}
  int origin() const { return origin_; }
  const std::string& original_message() const { return original_message_; }

 private:
  int origin_;
  std::string original_message_;
};

struct Unexpected {
  FrameHeader first;
  std::unique_ptr<uint8_t[]> data;  // uninitialised: every byte is written by a frame
  size_t capacity = 0;
  size_t received = 0;
  uint64_t arrival = 0;
  RequestPtr waiting;  // a receive posted while the message was still arriving
};

class Pair {
 public:
  static constexpr size_t kStripeBytes = 256 << 10;
  static constexpr size_t kStripeAlign = 64;  // a multiple of every sink unit (sink.h)
  // Frames with less payload are written by the caller when their socket is idle;
  // larger ones (sealed: more than one record) go to the send thread, if any. Handing a frame over costs two thread
  // wake-ups: below ~512K that showed as +20-25 % CPU per byte (N=4, 1-4 MB all-reduce).
  static constexpr size_t kInlineBytes = 512 << 10;
  static constexpr int kMaxIov = 64;  // frames gathered into one sendmsg()

  // Records sealed ahead of what the socket took, per frame.
  static constexpr size_t kSealAhead = 4;

  // `keys`: empty (frames go bare) or one per socket (the Communicator checked the
  // shape); `mode`: kMac or kAead, what the keys do (ignored without keys).
  Pair(PairHost& host, int peer_rank, std::string peer_addr, uint64_t comm_id,
       std::vector<Fd> fds, const std::vector<FrameKeys>& keys = {},
       WireSecurity mode = WireSecurity::kAead);

  int peer_rank() const { return peer_rank_; }
  const std::string& peer_addr() const { return peer_addr_; }
  std::string who() const;  // "peer=host:port (rank r)"
  size_t num_conns() const { return conns_.size(); }
  int conn_fd(size_t i) const { return conns_[i].fd.get(); }
  // Whether the progress thread must poll this socket for POLLOUT: only while no send
  // thread writes for it.
  bool conn_wants_write(size_t i) const { return !writer_running() && !conns_[i].sendq.empty(); }
  // Whether it must poll it for POLLIN: not while a receive thread reads it.
  bool conn_wants_read(size_t i) const { return !conns_[i].lent; }
  bool conn_open(size_t i) const { return conns_[i].fd.valid(); }

  // Bulk frames go to `writer` from now on (its mutex then guards the send queues).
  void use_writer(SendThread* writer) { writer_ = writer; }
  // Large payloads arriving on socket i are read by readers[i % size] from now on.
  void use_readers(std::vector<RecvThread*> readers) { readers_ = std::move(readers); }
  // Progress thread: a socket lent to a receive thread came back (payload read, or the
  // read failed: then it throws PeerLost).
  void on_returned(const RecvDone& d);
  void touch_read() {
    last_read_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }
  // Records of queued frames to seal before they can be written: claimed with the send
  // lock held, sealed without it (by the one thread writing the socket), then committed
  // with it held again.
  struct SealJob {
    size_t conn;
    void* item;  // a SendItem, which stays queued until its frame is written
    size_t from, to;  // units: 0 the header's tag, i + 1 payload record i
  };
  static constexpr int kMaxSealJobs = 16;
  int claim_seal(size_t conn, SealJob* jobs);
  void seal(const SealJob* jobs, int n);
  void commit_seal(const SealJob* jobs, int n);
  // For the send thread, with writer->mu() held.
  bool has_queued(size_t conn) const { return !conns_[conn].sendq.empty(); }
  int gather_iov(size_t conn, struct iovec* iov) const;
  void advance(size_t conn, size_t written, std::vector<SentFrame>* sent);
  // Progress thread: completes what the send thread wrote, or fails the link.
  void on_sent(const SentFrame& f);
  [[noreturn]] void send_failed(int err) { lost("send failed", err); }

  void post_send(const RequestPtr& req);
  void post_recv(const RequestPtr& req);

  // Unexpected p2p message with this key, if any (for any-source matching).
  Unexpected* find_unexpected(const MsgKey& key);
  // Binds `req` to the unexpected message of `key` (completing it if fully arrived).
  void take_unexpected(const MsgKey& key, const RequestPtr& req);
  // Registers `req` (already given peer/key) as the receive of frames with its key.
  void add_posted(const RequestPtr& req) { posted_[req->key] = req; }

  // Event handlers; throw Error on a broken link or a bad frame.
  void on_readable(size_t conn);
  void on_writable(size_t conn);

  // Best effort, bounded by `deadline`: queue-jump a control frame on every socket
  // that is at a frame boundary (finishing a half-written frame first if needed).
  void send_control(const FrameHeader& h, const std::string& payload, Deadline deadline);

  // Fails everything this pair holds and closes its sockets.
  void fail_all(const std::shared_ptr<const Error>& err, std::vector<RequestPtr>* failed);
  void close();
  // Clean hand-back of borrowed sockets (release.cc); see Transport::release.
  bool release(Deadline deadline);

  // Oldest pending request of a channel (for timeout messages), or null.
  RequestPtr oldest_pending(Channel chan) const;
  bool has_pending() const;
  bool has_pending_send(Channel chan) const;
  // When a socket of this link last took bytes (or a send was queued on an idle one).
  Clock::time_point last_write() const {
    return Clock::time_point(Clock::duration(last_write_.load(std::memory_order_relaxed)));
  }
  // When bytes last arrived from this peer.
  Clock::time_point last_read() const {
    return Clock::time_point(Clock::duration(last_read_.load(std::memory_order_relaxed)));
  }
  // Headers of the collective messages buffered before their op started.
  std::vector<FrameHeader> unexpected_collective_headers() const;

  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  uint64_t bytes_received() const { return bytes_received_.load(std::memory_order_relaxed); }

 private:
  struct SendItem {
    RequestPtr req;            // null for control frames
    uint8_t header[kFrameHeaderBytes + kTagBytes];  // sealed: the header's tag follows it
    size_t header_len = kFrameHeaderBytes;
    size_t header_sent = 0;
    const uint8_t* payload = nullptr;
    size_t length = 0;         // payload bytes
    size_t body = 0;           // wire bytes after the header: length, or sealed_bytes(length)
    size_t sent = 0;           // of body
    // sealed frames: units sealed (0: none; 1: the header's tag; 1 + i: record i - 1 too)
    size_t sealed = 0;
    uint8_t tags[kSealAhead][kTagBytes];  // record i's tag in tags[i % kSealAhead]
    std::unique_ptr<uint8_t[]> stage;     // kAead: record i's ciphertext in slot i % kSealAhead
    bool started() const { return header_sent > 0; }
  };
  struct Conn {
    Fd fd;
    bool bye = false;  // the peer closes this socket in an orderly way after BYE
    std::deque<SendItem> sendq;
    std::vector<std::unique_ptr<uint8_t[]>> spare_stages;  // kSealAhead-record stages for reuse
    // receive state
    bool in_payload = false;
    uint8_t header_buf[kFrameHeaderBytes + kTagBytes];
    size_t header_have = 0;
    FrameHeader cur;
    Landing land;               // where the current payload goes
    bool lent = false;          // a receive thread reads the payload (and owns `land`)
    RequestPtr target;          // posted receive being filled
    Unexpected* unexpected = nullptr;
    std::string control;        // abort payload being read
    std::vector<uint8_t> rbuf;  // staging for headers and small payloads
    size_t rb_begin = 0, rb_end = 0;
    // sealed frames (null: bare): what this side sends, what the peer sent
    std::unique_ptr<RecordCipher> sealer, opener;
  };

  // may_inline false: the send thread (if any) writes it, even when small.
  void enqueue(size_t conn, SendItem&& item, bool may_inline = true);
  // Writes what the socket takes now; finished frames go to *sent. Returns the errno of
  // a failed write, else 0.
  int write_queued(size_t conn, std::vector<SentFrame>* sent);
  void flush(size_t conn);  // write_queued, then completes or fails on this thread
  bool writer_running() const { return writer_ && !writer_->halted(); }
  std::unique_lock<std::mutex> send_lock() const {
    return writer_ ? std::unique_lock<std::mutex>(writer_->mu()) : std::unique_lock<std::mutex>();
  }
  void touch_write() {
    last_write_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  }
  void on_header(Conn& c);
  // Starts landing h's payload in req's buffer (checks that it holds whole sink units).
  void land_in(Conn& c, const RequestPtr& req, const FrameHeader& h);
  void on_payload_done(Conn& c);  // the frame is whole (and authentic): act on it
  // Wire bytes of a frame's header: with its tag when sealed.
  size_t header_bytes() const { return sealed_ ? kFrameHeaderBytes + kTagBytes : kFrameHeaderBytes; }
  // Checks the tag of the header c.header_buf holds (sealed frames); throws AuthError.
  void open_header(Conn& c);
  [[noreturn]] void auth_failed();
  // The wire bytes of a control frame written now on c (sealed with c's control stream).
  std::string control_frame(Conn& c, const FrameHeader& h, const std::string& payload);
  // Seals units [from, to) of a queued frame on c (see SealJob).
  void seal_units(Conn& c, SendItem& it, size_t from, size_t to);
  uint8_t* stage_slot(SendItem& it, size_t record) const;
  void on_eof(size_t conn);
  bool read_to_bye(Conn& c, Deadline deadline);
  [[noreturn]] void lost(const std::string& what, int err);
  void drain_for_abort();
  void finish_recv(const RequestPtr& req);
  void copy_out(Unexpected& u, const RequestPtr& req);
  void check_recv_size(const RequestPtr& req, const FrameHeader& h);

  PairHost& host_;
  const int peer_rank_;
  const std::string peer_addr_;
  const uint64_t comm_id_;
  const bool sealed_;  // frames carry tags (keys given)
  std::vector<Conn> conns_;
  size_t next_conn_ = 0;  // round-robin socket for small messages
  size_t byes_ = 0;  // sockets on which the peer said BYE (orderly shutdown)
  bool draining_ = false;
  std::atomic<Clock::rep> last_write_{Clock::now().time_since_epoch().count()};
  size_t queued_ = 0;  // frames in all send queues
  SendThread* writer_ = nullptr;
  std::atomic<Clock::rep> last_read_{0};
  std::vector<RecvThread*> readers_;
  std::unordered_map<MsgKey, RequestPtr, MsgKeyHash> posted_;
  std::unordered_map<MsgKey, Unexpected, MsgKeyHash> unexpected_;
  std::atomic<uint64_t> bytes_sent_{0};
  std::atomic<uint64_t> bytes_received_{0};
};

}  // namespace mccl
