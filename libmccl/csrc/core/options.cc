#include "core/options.h"

#include <string>

#include "core/clock.h"
#include "core/errors.h"

namespace mccl {

void Options::validate() const {
  auto bad = [](const std::string& what) {
    throw_error(ErrorKind::kConfig, "[engine] invalid option " + what);
  };
  if (sockets_per_peer < 1 || sockets_per_peer > 16) {
    bad("sockets_per_peer=" + std::to_string(sockets_per_peer) + ": must be 1..16 (MCCL_SOCKETS_PER_PEER)");
  }
  if (recv_threads < 0 || recv_threads > 16) {
    bad("recv_threads=" + std::to_string(recv_threads) + ": must be 0..16 (MCCL_RECV_THREADS)");
  }
  if (socket_buffer_bytes < (64 << 10)) {
    bad("socket_buffer_bytes=" + std::to_string(socket_buffer_bytes) +
        ": must be at least 64K (MCCL_SOCKET_BUFFER_BYTES)");
  }
  if (segment_bytes != 0 && segment_bytes < (4 << 10)) {
    bad("segment_bytes=" + std::to_string(segment_bytes) + ": must be 0 or at least 4K (MCCL_SEGMENT_BYTES)");
  }
  if (pipeline_bytes < (4 << 10)) {
    bad("pipeline_bytes=" + std::to_string(pipeline_bytes) + ": must be at least 4K (MCCL_PIPELINE_BYTES)");
  }
  for (int sw : switch_of_rank) {
    if (sw < 0) bad("switch_of_rank: switch ids must not be negative (MCCL_TOPOLOGY)");
  }
  if (!(alpha_us >= 0)) bad("alpha_us=" + format_seconds(alpha_us) + ": must be >= 0 (MCCL_ALPHA_US)");
  if (!(beta_gbps >= 0)) bad("beta_gbps=" + format_seconds(beta_gbps) + ": must be >= 0 (MCCL_BETA_GBPS)");
  if (compression < 0 || compression > 3) {
    bad("compression=" + std::to_string(compression) + ": must be 0..3 (off, bf16, fp16, int8; MCCL_COMPRESSION)");
  }
  if (compression_threads < 1 || compression_threads > kMaxCompressionThreads) {
    bad("compression_threads=" + std::to_string(compression_threads) + ": must be 1.." +
        std::to_string(kMaxCompressionThreads) + " (MCCL_COMPRESSION_THREADS)");
  }
  if (!(timeout_s > 0)) bad("timeout_s=" + format_seconds(timeout_s) + ": must be positive");
  if (!(connect_timeout_s > 0)) {
    bad("connect_timeout_s=" + format_seconds(connect_timeout_s) + ": must be positive");
  }
}

}  // namespace mccl
