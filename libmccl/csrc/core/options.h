// Engine knobs, filled from mccl_common.settings.EngineConfig by the Python side (which
// declares the MCCL_* variables, defaults and units once). Plain data.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace mccl {

// What protects a link's frames (MCCL_WIRE_SECURITY). kMac and kAead need a job secret:
// the links then open with a challenge-response on it and derive per-socket keys.
enum class WireSecurity : int { kOff = 0, kMac = 1, kAead = 2 };

struct Options {
  int sockets_per_peer = 2;             // sockets per peer link (1..16)
  int socket_buffer_bytes = 4 << 20;    // SO_SNDBUF/SO_RCVBUF, bytes
  size_t segment_bytes = 0;             // ring pipeline segment, bytes; 0 = by message size
  size_t small_allreduce_bytes = 65536; // one-round all-reduce up to this many link bytes ((N-1) x size)
  size_t pipeline_bytes = 2 << 20;      // piece of an op with tickets (ticket.h), bytes
  bool send_thread = true;              // bulk frames written to the sockets by a second thread
  int recv_threads = 2;                 // threads reading (and reducing) bulk payloads; 0: none
  double timeout_s = 1800.0;            // per operation, seconds
  double connect_timeout_s = 1800.0;    // building the mesh, seconds
  WireSecurity wire_security = WireSecurity::kOff;  // frames: encrypted, authenticated or bare
  // The switch of every rank (MCCL_TOPOLOGY; algorithms/hierarchical.cc), identical on every
  // rank; empty: one switch. All-reduces of at least hierarchy_min_bytes then run reduce-
  // scatter within each switch, all-reduce across switches, all-gather within each switch.
  std::vector<int> switch_of_rank;
  size_t hierarchy_min_bytes = 1 << 20;  // MCCL_HIERARCHY_MIN_BYTES, bytes
  // MCCL_HIERARCHY: ring (true), those all-reduces run as one ring that visits the switches in
  // turn (each uplink crossed once each way); tree (false), reduce-scatter/all-reduce/all-gather.
  bool hierarchy_ring = true;
  std::string algo = "auto";            // MCCL_ALGO: algorithm pins (algorithms/cost_model.h)
  double alpha_us = 0;                  // MCCL_ALPHA_US: the model's step latency, us; 0 = measure
  double beta_gbps = 0;                 // MCCL_BETA_GBPS: the model's link speed, Gbit/s; 0 = measure
  // MCCL_COMPRESSION (compress/codec.h Codec: 0 off, 1 bf16, 2 fp16, 3 int8): SUM and AVG
  // all-reduces and reduce-scatters of at least compression_min_bytes whose dtype the codec
  // encodes run compressed (algorithms/compressed.cc).
  int compression = 0;
  size_t compression_min_bytes = 64 << 10;  // MCCL_COMPRESSION_MIN_BYTES, bytes
  bool compression_feedback = true;          // MCCL_COMPRESSION_ERROR_FEEDBACK
  // MCCL_COMPRESSION_THREADS: threads sharing a compressed op's codec work, the worker
  // included (1: the worker alone); a communicator starts the helpers at its first such op.
  int compression_threads = 1;
  static constexpr int kMaxCompressionThreads = 64;
  // MCCL_COMPRESSION_FEEDBACK_MAX_BYTES: the residuals kept at most (least recently used go
  // first); 0: no cap. mccld keeps them for its jobs, so a job cannot grow it without bound.
  size_t compression_feedback_max_bytes = 0;

  // Throws ConfigError naming the bad field.
  void validate() const;
};

}  // namespace mccl
