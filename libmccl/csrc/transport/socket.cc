#include "transport/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>

#include "core/errors.h"

namespace mccl {

void Fd::reset() {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

std::string HostPort::str() const {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

HostPort parse_host_port(const std::string& s, const std::string& what) {
  HostPort hp;
  std::string port_str;
  if (!s.empty() && s[0] == '[') {
    auto close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':') {
      throw_error(ErrorKind::kConfig, "[transport] bad address '" + s + "' for " + what +
                                          "; expected host:port or [v6]:port");
    }
    hp.host = s.substr(1, close - 1);
    port_str = s.substr(close + 2);
  } else {
    auto colon = s.rfind(':');
    if (colon == std::string::npos || colon == 0) {
      throw_error(ErrorKind::kConfig, "[transport] bad address '" + s + "' for " + what +
                                          "; expected host:port");
    }
    hp.host = s.substr(0, colon);
    port_str = s.substr(colon + 1);
  }
  char* end = nullptr;
  long port = std::strtol(port_str.c_str(), &end, 10);
  if (port_str.empty() || *end != '\0' || port <= 0 || port > 65535) {
    throw_error(ErrorKind::kConfig, "[transport] bad port in address '" + s + "' for " + what +
                                        "; expected 1..65535");
  }
  hp.port = static_cast<int>(port);
  return hp;
}

namespace {

struct AddrInfo {
  addrinfo* res = nullptr;
  ~AddrInfo() {
    if (res) freeaddrinfo(res);
  }
};

void resolve(const std::string& host, int port, bool passive, AddrInfo* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  std::string port_s = std::to_string(port);
  const char* h = host.empty() ? nullptr : host.c_str();
  int rc = getaddrinfo(h, port_s.c_str(), &hints, &out->res);
  if (rc != 0) {
    throw_error(ErrorKind::kConfig, "[transport] cannot resolve '" + host + "': " +
                                        gai_strerror(rc) + "; check the address or MCCL_BIND_ADDR");
  }
}

}  // namespace

Fd listen_tcp(const std::string& host, int port, int* bound_port) {
  AddrInfo ai;
  resolve(host, port, true, &ai);
  std::string last_err = "no address";
  for (addrinfo* a = ai.res; a; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
    if (!fd.valid()) {
      last_err = std::strerror(errno);
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    ::fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 512) != 0) {
      last_err = std::strerror(errno);
      continue;
    }
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&ss), &len);
    *bound_port = ntohs(ss.ss_family == AF_INET6
                            ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                            : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
    return fd;
  }
  throw_error(ErrorKind::kConfig, "[transport] cannot listen on " + host + ":" +
                                      std::to_string(port) + ": " + last_err +
                                      "; pick another address/port (MCCL_BIND_ADDR)");
}

Fd connect_tcp(const HostPort& peer, Deadline deadline, int peer_rank,
               const std::atomic<bool>* cancel) {
  AddrInfo ai;
  resolve(peer.host, peer.port, false, &ai);
  auto backoff = std::chrono::milliseconds(5);
  std::string last_err;
  while (true) {
    for (addrinfo* a = ai.res; a; a = a->ai_next) {
      Fd fd(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
      if (!fd.valid()) {
        last_err = std::strerror(errno);
        continue;
      }
      ::fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
      set_nonblocking(fd.get(), true);
      int rc = ::connect(fd.get(), a->ai_addr, a->ai_addrlen);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        int pr = ::poll(&p, 1, std::max(ms_until(deadline, 5000), 1));
        if (pr == 1) {
          int err = 0;
          socklen_t len = sizeof(err);
          ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
          rc = err == 0 ? 0 : -1;
          errno = err;
        } else {
          rc = -1;
          errno = ETIMEDOUT;
        }
      }
      if (rc == 0) {
        set_nonblocking(fd.get(), false);
        return fd;
      }
      last_err = std::strerror(errno);
    }
    if (cancel && cancel->load()) return Fd();
    if (Clock::now() + backoff >= deadline) break;
    std::this_thread::sleep_for(backoff);  // the peer is not listening yet: retry
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
  throw_error(ErrorKind::kTimeout,
              "[transport] Timed out connecting to peer=" + peer.str() + " (rank " +
                  std::to_string(peer_rank) + "): " + last_err +
                  "; likely cause: that rank did not start, crashed, or its address is not "
                  "reachable from here; check it is running and MCCL_BIND_ADDR/firewall",
              peer_rank, peer.str());
}

Fd accept_tcp(int listen_fd, Deadline deadline) {
  while (true) {
    pollfd p{listen_fd, POLLIN, 0};
    int pr = ::poll(&p, 1, ms_until(deadline, 1000));
    if (pr > 0) {
      int fd = ::accept(listen_fd, nullptr, nullptr);
      if (fd >= 0) {
        ::fcntl(fd, F_SETFD, FD_CLOEXEC);
        return Fd(fd);
      }
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
        throw_error(ErrorKind::kGeneric,
                    std::string("[transport] accept failed: ") + std::strerror(errno) +
                        "; likely out of file descriptors; raise ulimit -n");
      }
    } else if (pr < 0 && errno != EINTR) {
      throw_error(ErrorKind::kGeneric, std::string("[transport] poll failed: ") +
                                           std::strerror(errno));
    }
    if (Clock::now() >= deadline) return Fd();
  }
}

void configure_link_socket(int fd, int buffer_bytes) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
#ifdef SO_NOSIGPIPE
  ::setsockopt(fd, SOL_SOCKET, SO_NOSIGPIPE, &one, sizeof(one));
#endif
  // A peer host that loses power or its cable sends no FIN: keepalive probes turn the
  // silent link into an error within about a minute instead of the op timeout (which
  // may be 30 min). A stopped or busy process still answers them from its kernel.
  int idle_s = 20, interval_s = 5, count = 4;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
#if defined(TCP_KEEPIDLE)
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle_s, sizeof(idle_s));
#elif defined(TCP_KEEPALIVE)  // macOS spelling
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPALIVE, &idle_s, sizeof(idle_s));
#endif
#ifdef TCP_KEEPINTVL
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof(interval_s));
#endif
#ifdef TCP_KEEPCNT
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
#endif
}

void set_nonblocking(int fd, bool on) {
  int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

void make_wake_pipe(Fd* read_end, Fd* write_end, const char* who) {
  int fds[2];
  if (::pipe(fds) != 0) {
    throw_error(ErrorKind::kGeneric, std::string("[transport] pipe() for the ") + who +
                                         " failed: " + std::strerror(errno) + "; raise ulimit -n");
  }
  *read_end = Fd(fds[0]);
  *write_end = Fd(fds[1]);
  for (int fd : fds) {
    set_nonblocking(fd, true);
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }
}

int nosignal_flag() {
#ifdef MSG_NOSIGNAL
  return MSG_NOSIGNAL;
#else
  return 0;
#endif
}

bool write_all(int fd, const void* buf, size_t n, Deadline deadline,
               const std::atomic<bool>* cancel) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    pollfd pf{fd, POLLOUT, 0};
    int pr = ::poll(&pf, 1, ms_until(deadline, 200));
    if (pr < 0 && errno != EINTR) return false;
    if (pr <= 0) {
      if (Clock::now() >= deadline || (cancel && cancel->load())) return false;
      continue;
    }
    ssize_t w = ::send(fd, p, n, nosignal_flag());
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* buf, size_t n, Deadline deadline, const std::atomic<bool>* cancel) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    pollfd pf{fd, POLLIN, 0};
    int pr = ::poll(&pf, 1, ms_until(deadline, 200));
    if (pr < 0 && errno != EINTR) return false;
    if (pr <= 0) {
      if (Clock::now() >= deadline || (cancel && cancel->load())) return false;
      continue;
    }
    ssize_t r = ::recv(fd, p, n, 0);
    if (r == 0) return false;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return false;
    }
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::string remote_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = {0};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
  ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
  port = ntohs(a->sin6_port);
  return "[" + std::string(host) + "]:" + std::to_string(port);
}

}  // namespace mccl
