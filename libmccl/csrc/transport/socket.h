// TCP plumbing shared by the mesh set-up and the progress engine: an owning fd,
// listen/accept/connect under a deadline, socket options, and blocking-with-deadline
// read/write used only during the handshake (the data path is nonblocking).
// Portable Linux + macOS: only poll(), no epoll/kqueue.
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <string>

#include "core/clock.h"

namespace mccl {

class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset();

 private:
  int fd_ = -1;
};

struct HostPort {
  std::string host;
  int port = 0;
  std::string str() const;
};

// "host:port", "[v6addr]:port". Throws Error(kConfig) naming `what` on bad input.
HostPort parse_host_port(const std::string& s, const std::string& what);

// Binds and listens; port 0 picks a free one. Returns the fd and the bound port.
Fd listen_tcp(const std::string& host, int port, int* bound_port);

// Connects, retrying refused/unreachable attempts with backoff until `deadline`
// (peers start at different times). Throws a Timeout error naming `peer`. Returns an
// invalid Fd if `cancel` becomes true (another part of the set-up failed).
Fd connect_tcp(const HostPort& peer, Deadline deadline, int peer_rank,
               const std::atomic<bool>* cancel = nullptr);

// Waits for one connection until `deadline`; returns an invalid Fd on timeout.
Fd accept_tcp(int listen_fd, Deadline deadline);

// TCP_NODELAY, SO_SNDBUF/SO_RCVBUF, keepalive and (on macOS) SO_NOSIGPIPE.
void configure_link_socket(int fd, int buffer_bytes);
void set_nonblocking(int fd, bool on);
// A nonblocking close-on-exec pipe for waking a thread out of poll(); throws naming `who`.
void make_wake_pipe(Fd* read_end, Fd* write_end, const char* who);

// Blocking I/O with a deadline (handshake only). Return false on timeout, EOF or when
// `cancel` becomes true; throw nothing, so the caller can phrase the error in context.
bool write_all(int fd, const void* buf, size_t n, Deadline deadline,
               const std::atomic<bool>* cancel = nullptr);
bool read_all(int fd, void* buf, size_t n, Deadline deadline,
              const std::atomic<bool>* cancel = nullptr);

// "1.2.3.4:5678" of the remote end, or "?" if unknown.
std::string remote_address(int fd);

// Flags for send()/sendmsg() that suppress SIGPIPE where the platform has one.
int nosignal_flag();

}  // namespace mccl
