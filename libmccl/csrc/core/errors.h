// Typed engine errors. Each kind maps one-to-one onto a Python exception class in
// mccl_common/errors.py; the binding layer does the translation.
#pragma once
#include <stdexcept>
#include <string>

namespace mccl {

enum class ErrorKind : int {
  kGeneric = 0,     // MCCLError
  kPeerLost = 1,    // PeerLostError: a peer died, closed its link or reset it
  kTimeout = 2,     // CollectiveTimeout: an operation passed its deadline
  kConfig = 3,      // ConfigError: bad argument or setting (sizes, dtype/op, ranks)
  kProtocol = 4,    // ProtocolError: malformed frame, version/communicator mismatch
  kMismatch = 5,    // CollectiveMismatch: ranks disagree on op, size or order
  kAborted = 6,     // AbortedError: the communicator was aborted or shut down
  // 7 is DaemonUnavailableError, raised only by Python.
  kAuth = 8,        // AuthError: a peer did not prove the job key, or a frame failed authentication
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg, int peer_rank = -1,
        std::string peer_addr = "")
      : std::runtime_error(msg),
        kind_(kind),
        peer_rank_(peer_rank),
        peer_addr_(std::move(peer_addr)) {}
  ErrorKind kind() const { return kind_; }
  int peer_rank() const { return peer_rank_; }
  const std::string& peer_addr() const { return peer_addr_; }

 private:
  ErrorKind kind_;
  int peer_rank_;
  std::string peer_addr_;
};

// Messages follow "[component] what failed, peer=host:port, likely cause, what to do".
[[noreturn]] void throw_error(ErrorKind kind, const std::string& msg, int peer_rank = -1,
                              const std::string& peer_addr = "");

}  // namespace mccl
