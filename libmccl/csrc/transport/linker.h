// Links on demand: a communicator's links to its peers, opened when first needed rather
// than to every rank at set-up (at N ranks a full mesh is N-1 links a rank and ~N^2
// connections in all; a rank of 200 would hold 398 sockets).
//
// The Linker owns the communicator's listening socket for its whole life. Its acceptor
// thread proves every connection with the keyed handshake (handshake.h), so a peer may
// dial in at any time, not only during set-up. `want(peer)` dials a peer on a dialer
// thread (at most kMaxDialers at once). Finished links wait in a queue for the transport,
// which is woken to adopt them.
//
// Strangers (anyone on the LAN can connect; only a holder of the job key can prove it):
// the acceptor drives every unproved connection itself, from one poll loop and with
// nonblocking reads, so a connection that stays silent costs a file descriptor and a
// hundred bytes, never a thread. Unproved connections are capped per source host
// (kMaxUnprovedPerHost) and in all (kMaxUnproved); a new connection beyond a cap makes
// room by dropping the oldest of the busiest host (one that sent no hello before one
// that did), so a flood from one host never keeps out another's, and on one host
// (loopback) the newest connection, the one a real peer just dialed and on which its
// hello is already on the way, is the one that stays. A stranger's hello is due within
// kHelloBudget and its proof soon after the challenge; a real peer sends both at once. A
// connection whose proof is due but still young is never dropped for room (its dialer
// would read the drop as a refused key): when only those remain, new connections wait in
// the kernel's backlog. A failed or dropped connection is logged once per host
// (rejects.h).
//
// A dialer whose connection the peer closed before its challenge (dropped for room) dials
// again with backoff until its deadline; if that passes, the error names the peer and
// how often its listener closed our handshake.
//
// Who dials: the rank that needs the link (the sender of the first message; at set-up, the
// lower rank of each pair of collective partners). A receiver never dials: the message it
// waits for comes with its sender's dial, so a rank that only receives (an any-source
// receive, the root of a gather) needs no dial of its own, and only one side wanting
// the link cannot deadlock. When both dial at once, the lower rank's dial wins: each
// side's per-peer state (under one mutex) says whether it is dialing, and an acceptor
// that is itself dialing a higher rank declines that rank's connection in the handshake
// (a proved verdict, kDeclinedStatus); the declined dialer closes its socket and waits for
// the winner's connection, which its own acceptor takes. A link is adopted only whole
// (all its sockets proved), so the transport never sees half a link.
//
// Sockets per link (sockets_for): MCCL_SOCKETS_PER_PEER (K) to ring neighbours, which
// carry the bulk of the ring algorithms back to back and gain from striping across K
// sockets; 1 to every other peer (hypercube and fold partners, and the peers of
// gather/scatter/all-to-all/point-to-point), whose exchanges are a log N few per op: with
// ~log2 N such partners, K for all of them would double the open files for little gain.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "transport/handshake.h"
#include "transport/helper_threads.h"
#include "transport/link_source.h"
#include "transport/mesh.h"
#include "transport/rejects.h"

namespace mccl {

// Unproved connections the acceptor holds at once, from one source host and in all.
constexpr int kMaxUnprovedPerHost = 32;
constexpr int kMaxUnproved = 128;

class Linker : public LinkSource {
 public:
  static constexpr int kMaxDialers = 8;

  // `listen_fd` is owned from here (closed by stop()). `link_timeout_s` bounds each
  // dial (connect retries and handshakes) started by want().
  Linker(MeshSpec spec, Fd listen_fd, double link_timeout_s);
  ~Linker() override;  // stop()
  Linker(const Linker&) = delete;
  Linker& operator=(const Linker&) = delete;

  // The sockets of the link between ranks a and b (see the file comment).
  static int sockets_for(int a, int b, int size, int sockets_per_peer);

  // LinkSource. want(peer) dials `peer` unless a link to it is up, being dialed or being
  // accepted; take_error gives the first failed dial or refused proved peer.
  void on_event(std::function<void()> fn) override;
  void want(int peer) override;
  // Set-up: blocks until the links to every rank of `peers` are ready and takes them out
  // of the queue (others stay there for the transport). Throws a typed Timeout at
  // `deadline` naming the first missing rank (and who failed the proof of the key, if
  // anyone did), a dial's error, or Aborted once `*cancel` is set.
  MeshLinks wait_for(const std::vector<int>& peers, Deadline deadline,
                     const std::atomic<bool>* cancel);
  void take_ready(std::vector<NewLink>* out) override;
  std::shared_ptr<const Error> take_error() override;
  bool linking(int peer) const override;
  const char* missing_link() const override { return "which this rank dialed and which never answered"; }
  // Its own listener's links are never reused: always settled.
  bool settled() const override { return true; }
  // Also stops accepting and closes the listening socket.
  void stop() override;

 private:
  enum class State { kNone, kDialing, kAccepting, kUp };
  struct Peer {
    State state = State::kNone;
    bool dialed = false;  // kUp by our own dial
    std::vector<Fd> fds;  // accepted sockets, by index (kAccepting)
    std::vector<FrameKeys> keys;
    std::vector<bool> reserved;  // a proved connection is being answered for that index
    int closed_early = 0;        // our dials it closed before its challenge (a full listener?)
  };
  struct Unproved;  // a connection the acceptor holds before its proof (linker.cc)

  Hello hello(int to_rank, int sock_index) const;
  void accept_main();
  void accept_new(std::list<Unproved>* unproved);
  bool make_room(std::list<Unproved>* unproved, const std::string& host, bool any_host);
  void read_some(Unproved* u);
  void finish(Unproved* u);
  void drop_for_room(const std::string& host, const std::string& from);
  int claim_slot(uint32_t from, uint32_t sock, int* held);  // kSlot*, under mu_
  void dial_main();
  void dial_one(int peer);
  void ready_locked(int peer, std::vector<Fd> fds, std::vector<FrameKeys> keys);
  void fire();

  const MeshSpec spec_;
  Fd listen_fd_;
  const double link_timeout_s_;
  Rejects rejects_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  std::condition_variable cv_;  // a link became ready, or a dial failed
  std::vector<Peer> peers_;
  std::deque<NewLink> ready_;
  std::deque<int> dial_queue_;
  int dialers_ = 0;  // dialer threads running
  HelperThreads dialer_threads_;
  FirstError error_;
  std::function<void()> on_event_;

  std::thread acceptor_;
  std::map<std::string, uint64_t> dropped_for_room_;  // by host; acceptor thread only
  uint64_t dropped_for_room_total_ = 0;                // under mu_
  std::mutex stop_mu_;
  bool stopped_ = false;
};

}  // namespace mccl
