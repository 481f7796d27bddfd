#include "core/errors.h"

namespace mccl {

void throw_error(ErrorKind kind, const std::string& msg, int peer_rank,
                 const std::string& peer_addr) {
  throw Error(kind, msg, peer_rank, peer_addr);
}

}  // namespace mccl
