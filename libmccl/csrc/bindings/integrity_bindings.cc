// The frame MAC's primitives (integrity/mac.h) for tests (RFC 8439 vectors, against a
// reference) and for measuring their cost per byte (scripts/frame_mac_cost.py).
#include "integrity_bindings.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/errors.h"
#include "integrity/mac.h"

namespace py = pybind11;

namespace mccl {
namespace {

const uint8_t* bytes_of(const py::bytes& b, size_t want, const char* what) {
  std::string_view v(b);
  if (want && v.size() != want)
    throw_error(ErrorKind::kConfig, std::string("[mac] ") + what + " must be " + std::to_string(want) +
                                        " bytes, got " + std::to_string(v.size()));
  return reinterpret_cast<const uint8_t*>(v.data());
}

}  // namespace

void register_integrity_bindings(py::module_& m) {
  m.def("chacha20_block", [](py::bytes key, uint32_t counter, py::bytes nonce) {
    uint8_t out[64];
    chacha20_block(bytes_of(key, 32, "key"), counter, bytes_of(nonce, 12, "nonce"), out);
    return py::bytes(reinterpret_cast<char*>(out), sizeof out);
  }, py::arg("key"), py::arg("counter"), py::arg("nonce"));
  m.def("poly1305", [](py::bytes key, py::bytes msg) {
    std::string_view v(msg);
    uint8_t tag[kMacTagBytes];
    Poly1305 mac(bytes_of(key, 32, "key"));
    mac.update(reinterpret_cast<const uint8_t*>(v.data()), v.size());
    mac.finish(tag);
    return py::bytes(reinterpret_cast<char*>(tag), sizeof tag);
  }, py::arg("key"), py::arg("msg"));
  m.def("frame_tag", [](py::bytes key, uint32_t stream, uint64_t frame_no, py::bytes header, py::bytes payload) {
    std::string_view h(header), p(payload);
    uint8_t tag[kMacTagBytes];
    frame_tag(bytes_of(key, kMacKeyBytes, "link key"), stream, frame_no, reinterpret_cast<const uint8_t*>(h.data()),
              h.size(), reinterpret_cast<const uint8_t*>(p.data()), p.size(), tag);
    return py::bytes(reinterpret_cast<char*>(tag), sizeof tag);
  }, py::arg("key"), py::arg("stream"), py::arg("frame_no"), py::arg("header"), py::arg("payload"));
  // Seconds per byte of frame_tag over frames of `frame_bytes`, best of `repeats` passes over
  // `total_bytes` (a buffer larger than the caches, as received data is), without the GIL.
  m.def("frame_tag_seconds_per_byte", [](size_t frame_bytes, size_t total_bytes, int repeats) {
    if (frame_bytes == 0 || total_bytes < frame_bytes || repeats < 1)
      throw_error(ErrorKind::kConfig, "[mac] need 0 < frame_bytes <= total_bytes and repeats >= 1");
    std::vector<uint8_t> buf(total_bytes, 0x5a), hdr(72, 1);
    uint8_t key[kMacKeyBytes] = {7}, tag[kMacTagBytes];
    double best = 1e30;
    uint64_t sink = 0;
    {
      py::gil_scoped_release nogil;
      for (int r = 0; r < repeats; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        uint64_t n = 0;
        for (size_t off = 0; off + frame_bytes <= total_bytes; off += frame_bytes) {
          frame_tag(key, 1, n++, hdr.data(), hdr.size(), buf.data() + off, frame_bytes, tag);
          sink += tag[0];
        }
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        best = std::min(best, s / double((total_bytes / frame_bytes) * frame_bytes));
      }
    }
    (void)sink;
    return best;
  }, py::arg("frame_bytes"), py::arg("total_bytes") = size_t(64) << 20, py::arg("repeats") = 3);
}

}  // namespace mccl
