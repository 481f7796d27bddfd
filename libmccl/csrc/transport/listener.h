// A bound, listening socket created before the peers' addresses are exchanged, so a
// rank can publish "host:port" first and build its communicator afterwards.
#pragma once
#include <string>

#include "transport/socket.h"

namespace mccl {

class Listener {
 public:
  Listener(const std::string& host, int port) : host_(host) {
    fd_ = listen_tcp(host, port, &port_);
  }
  std::string address() const { return HostPort{host_.empty() ? "0.0.0.0" : host_, port_}.str(); }
  int fd() const { return fd_.get(); }
  int port() const { return port_; }
  // A listener serves one communicator: later dialers must not reach a finished mesh.
  void close() { fd_.reset(); }
  bool closed() const { return !fd_.valid(); }

 private:
  std::string host_;
  int port_ = 0;
  Fd fd_;
};

}  // namespace mccl
