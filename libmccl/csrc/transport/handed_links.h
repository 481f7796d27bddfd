// Links on demand over sockets the communicator's owner connects and hands in (mccld's
// pooled data sockets, mccld/net/datalinks.py), beside the Linker's own dialing (linker.h).
//
// The transport's want(peer) is passed on to the owner's `ask` callback on a thread of our
// own (started at the first want), never on the worker: the callback may take locks of
// its own (mccld's takes the GIL), and the worker holds the transport's state. The owner
// gets sockets to that peer by its own protocol, in the background, and calls
// hand_in(peer, fds) on either side, the side that asked and the side that did not: a
// receiver never asks, its peer's send brings the link. hand_in dup()s the fds at once
// and runs the same keyed handshake as the constructor's handed-in sockets (mesh.h
// prove_link) on a handshake thread, bounded by `link_timeout_s`; the link is then queued
// ready and the transport woken. A failed handshake, or the owner's refuse(peer, ...),
// becomes the source's error, which fails the transport (every pending op, naming the peer).
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/helper_threads.h"
#include "transport/link_source.h"
#include "transport/mesh.h"

namespace mccl {

class HandedLinks : public LinkSource {
 public:
  using Ask = std::function<void(int peer)>;

  HandedLinks(MeshSpec spec, Ask ask, double link_timeout_s);
  ~HandedLinks() override;  // stop()
  HandedLinks(const HandedLinks&) = delete;
  HandedLinks& operator=(const HandedLinks&) = delete;

  // Marks the peers the constructor linked already (they are never asked for again).
  void linked(int peer);
  // The owner's sockets to `peer` (K of them; it keeps its fds). Throws a ConfigError when
  // that peer is linked or being linked already, or when the source stopped.
  void hand_in(int peer, const std::vector<int>& fds);
  // The owner cannot link `peer`: `kind` and `message` (which names the peer) become
  // the source's error.
  void refuse(int peer, ErrorKind kind, const std::string& message);

  void on_event(std::function<void()> fn) override;
  void want(int peer) override;
  void take_ready(std::vector<NewLink>* out) override;
  std::shared_ptr<const Error> take_error() override;
  bool linking(int peer) const override;
  bool settled() const override;
  const char* missing_link() const override {
    return "whose sockets the owner (mccld) never handed in: that host's daemon did not agree on them";
  }
  void stop() override;

 private:
  enum class State { kNone, kAsked, kProving, kReady, kUp };
  void ask_main();
  void prove(int peer, std::vector<Fd> fds);
  void fail_locked(const Error& e);
  void fire();

  const MeshSpec spec_;
  const Ask ask_;
  const double link_timeout_s_;
  std::atomic<bool> stop_{false};

  mutable std::mutex mu_;
  std::condition_variable ask_cv_;
  std::vector<State> state_;
  std::deque<int> asks_;       // peers to pass to ask_
  bool asker_running_ = false;
  std::thread asker_;
  HelperThreads provers_;  // one per link being proved (at most one per peer)
  std::deque<NewLink> ready_;
  FirstError error_;
  std::function<void()> on_event_;
  std::mutex stop_mu_;
  bool stopped_ = false;
};

}  // namespace mccl
