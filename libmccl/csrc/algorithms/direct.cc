// The collectives that are a single round of direct messages: gather, scatter,
// all-to-all(v). Post every send and receive, then wait for all of them.
#include <algorithm>
#include <cstring>

#include "algorithms/algorithms.h"

namespace mccl {

void gather(Collective& c, const void* send, void* recv, size_t nbytes, int root) {
  const int n = c.size(), r = c.rank();
  if (nbytes == 0) return;
  if (r != root) {
    c.send(root, send, nbytes, 0);
    c.wait_all(1);
    return;
  }
  uint8_t* out = static_cast<uint8_t*>(recv);
  std::memmove(out + size_t(r) * nbytes, send, nbytes);
  for (int q = 0; q < n; ++q) {
    if (q != r) c.recv(q, out + size_t(q) * nbytes, nbytes, 0);
  }
  c.wait_all(n - 1);
}

void scatter(Collective& c, const void* send, void* recv, size_t nbytes, int root) {
  const int n = c.size(), r = c.rank();
  if (nbytes == 0) return;
  if (r != root) {
    c.recv(root, recv, nbytes, 0);
    c.wait_all(1);
    return;
  }
  const uint8_t* in = static_cast<const uint8_t*>(send);
  for (int q = 0; q < n; ++q) {
    if (q != r) c.send(q, in + size_t(q) * nbytes, nbytes, 0);
  }
  std::memmove(recv, in + size_t(r) * nbytes, nbytes);
  c.wait_all(n - 1);
}

void alltoallv(Collective& c, const void* send, const std::vector<size_t>& send_sizes,
               const std::vector<size_t>& send_offsets, void* recv,
               const std::vector<size_t>& recv_sizes, const std::vector<size_t>& recv_offsets) {
  const int n = c.size(), r = c.rank();
  const uint8_t* in = static_cast<const uint8_t*>(send);
  uint8_t* out = static_cast<uint8_t*>(recv);
  size_t send_extent = 0, recv_extent = 0;
  for (int q = 0; q < n; ++q) {
    send_extent = std::max(send_extent, send_offsets[q] + send_sizes[q]);
    recv_extent = std::max(recv_extent, recv_offsets[q] + recv_sizes[q]);
  }
  // Receives land while sends are still reading: an aliased input must be copied first.
  if (ranges_overlap(in, send_extent, out, recv_extent)) {
    uint8_t* copy = c.scratch.get(2, send_extent);
    std::memcpy(copy, in, send_extent);
    in = copy;
  }
  size_t outstanding = 0;
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    c.recv(q, out + recv_offsets[q], recv_sizes[q], 0);
    c.send(q, in + send_offsets[q], send_sizes[q], 0);
    outstanding += 2;
  }
  // The diagonal sizes were checked when the op was enqueued.
  std::memcpy(out + recv_offsets[r], in + send_offsets[r], send_sizes[r]);
  c.wait_all(outstanding);
}

void alltoall(Collective& c, const void* send, void* recv, size_t nbytes) {
  const int n = c.size();
  std::vector<size_t> sizes(n, nbytes), offsets(n);
  for (int q = 0; q < n; ++q) offsets[q] = size_t(q) * nbytes;
  alltoallv(c, send, sizes, offsets, recv, sizes, offsets);
}

// An exchange of empty messages with every peer: the one-round small all-reduce with
// no payload. Nobody leaves before everybody has arrived.

}  // namespace mccl
