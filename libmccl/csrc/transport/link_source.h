// Where a transport's links on demand come from. Two sources: the Linker (linker.h), which
// dials and accepts over the communicator's own listener, and HandedLinks (handed_links.h),
// which asks the owner (mccld) for sockets it connects itself and hands in. The transport
// sees only this interface: it asks for a peer when its first send needs one, adopts the
// links that became ready, and fails on a source's error.
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include "core/errors.h"
#include "integrity/keys.h"
#include "transport/socket.h"

namespace mccl {

// One link, all its sockets proved, configured and nonblocking.
struct NewLink {
  int peer = -1;
  std::vector<Fd> fds;
  std::vector<FrameKeys> keys;  // one per socket; empty under kOff
};

// A source's first failure, kept until the transport takes it, once: later failures are
// consequences of the first (the job is failing) and would only hide its cause. Not locked:
// its owner guards it with its own mutex.
class FirstError {
 public:
  void set(const Error& e) {
    if (!error_) error_ = std::make_shared<const Error>(e);
  }
  bool failed() const { return error_ != nullptr; }
  // The failure, or null once it was taken (or there is none).
  std::shared_ptr<const Error> take() {
    if (!error_ || taken_) return nullptr;
    taken_ = true;
    return error_;
  }
  // Throws the failure, which counts as taking it. Only when failed().
  [[noreturn]] void throw_taken() {
    taken_ = true;
    throw *error_;
  }

 private:
  std::shared_ptr<const Error> error_;
  bool taken_ = false;
};

class LinkSource {
 public:
  virtual ~LinkSource() = default;
  // Called (any thread, without the source's lock) whenever a link is ready or linking
  // failed; set once, before want() is called.
  virtual void on_event(std::function<void()> fn) = 0;
  // A send to `peer` is waiting: link it unless a link is up or on its way. Any thread;
  // returns at once.
  virtual void want(int peer) = 0;
  // The links that became ready since the last call.
  virtual void take_ready(std::vector<NewLink>* out) = 0;
  // The first failure, once (a typed Error naming the peer), or null.
  virtual std::shared_ptr<const Error> take_error() = 0;
  // Whether a link to `peer` is being made now (for timeout messages).
  virtual bool linking(int peer) const = 0;
  // How a timeout names a link this rank asked for and never got (after "a link to peer=...").
  virtual const char* missing_link() const = 0;
  // True when nothing is on its way: every link begun was adopted (or none was begun).
  // Borrowed sockets with a half-made link on them cannot serve another communicator.
  virtual bool settled() const = 0;
  // Stops making links, joins its threads, closes what nobody took. Idempotent.
  virtual void stop() = 0;
};

}  // namespace mccl
