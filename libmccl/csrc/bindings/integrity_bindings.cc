// The frame sealing's record cipher (integrity/aead.h) for tests (known-answer vectors,
// tamper checks) and for measuring its cost per byte (scripts/wire_security_cost.py).
#include "integrity_bindings.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/errors.h"
#include "integrity/aead.h"

namespace py = pybind11;

namespace mccl {
namespace {

const uint8_t* bytes_of(const py::bytes& b, size_t want, const char* what) {
  std::string_view v(b);
  if (want && v.size() != want)
    throw_error(ErrorKind::kConfig, std::string("[aead] ") + what + " must be " + std::to_string(want) +
                                        " bytes, got " + std::to_string(v.size()));
  return reinterpret_cast<const uint8_t*>(v.data());
}

WireSecurity sealing_mode(WireSecurity mode) {
  if (mode == WireSecurity::kOff) throw_error(ErrorKind::kConfig, "[aead] a record cipher needs mode mac or aead");
  return mode;
}

py::bytes as_bytes(const std::string& s) { return py::bytes(s.data(), s.size()); }

// Seconds per byte of sealing (or opening) records of kRecordBytes, the header as
// associated data, over a buffer of `total_bytes` (larger than the caches, as the user's
// buffers are); best of `repeats` passes, without the GIL. Opening is timed on records
// sealed beforehand, in place, as the receive path does.
double seconds_per_byte(WireSecurity mode, bool open, size_t total_bytes, int repeats) {
  const size_t records = total_bytes / kRecordBytes;
  if (records == 0 || repeats < 1) throw_error(ErrorKind::kConfig, "[aead] need total_bytes >= 64K and repeats >= 1");
  std::vector<uint8_t> buf(records * kRecordBytes, 0x5a), tags(records * kTagBytes), hdr(72, 1), stage(kRecordBytes);
  const uint8_t key[kMacKeyBytes] = {7};
  double best = 1e30;
  py::gil_scoped_release nogil;
  for (int r = 0; r < repeats; ++r) {
    RecordCipher sealer(mode, key, true), opener(mode, key, false);
    auto t0 = std::chrono::steady_clock::now();
    // Sealing reads the user's buffer and writes a stage (kAead) as the send path does.
    for (size_t i = 0; i < records; ++i) {
      uint8_t* out = mode == WireSecurity::kAead ? (open ? buf.data() + i * kRecordBytes : stage.data()) : nullptr;
      sealer.seal(RecordStream::kData, hdr.data(), hdr.size(), buf.data() + i * kRecordBytes, out, kRecordBytes,
                  tags.data() + i * kTagBytes);
    }
    if (open) {
      t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < records; ++i) {
        if (!opener.open(RecordStream::kData, hdr.data(), hdr.size(), buf.data() + i * kRecordBytes, kRecordBytes,
                         tags.data() + i * kTagBytes)) {
          throw_error(ErrorKind::kGeneric, "[aead] a record sealed here failed to open");
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s / double(records * kRecordBytes));
  }
  return best;
}

}  // namespace

void register_integrity_bindings(py::module_& m) {
  m.attr("RECORD_BYTES") = kRecordBytes;
  m.attr("TAG_BYTES") = kTagBytes;
  // One direction of a socket: records are numbered by the cipher, per stream (0 data,
  // 1 control), from 0; the nonce is (stream, number), little-endian.
  py::class_<RecordCipher, std::shared_ptr<RecordCipher>>(m, "RecordCipher")
      .def(py::init([](WireSecurity mode, py::bytes key, bool seals) {
             return std::make_shared<RecordCipher>(sealing_mode(mode), bytes_of(key, kMacKeyBytes, "key"), seals);
           }),
           py::arg("mode"), py::arg("key"), py::arg("seals"))
      // (ciphertext or, for mac, the data unchanged; tag)
      .def("seal", [](RecordCipher& c, uint32_t stream, py::bytes aad, py::bytes data) {
             std::string a(aad), d(data);
             if (d.size() > kRecordBytes) throw_error(ErrorKind::kConfig, "[aead] a record holds at most 64 KiB");
             uint8_t tag[kTagBytes];
             auto* p = reinterpret_cast<uint8_t*>(&d[0]);
             c.seal(static_cast<RecordStream>(stream & 1), reinterpret_cast<const uint8_t*>(a.data()), a.size(), p,
                    p, d.size(), tag);
             return py::make_tuple(as_bytes(d), py::bytes(reinterpret_cast<char*>(tag), kTagBytes));
           },
           py::arg("stream"), py::arg("aad"), py::arg("data"))
      // The opened record, or None when its tag does not match.
      .def("open", [](RecordCipher& c, uint32_t stream, py::bytes aad, py::bytes data, py::bytes tag) -> py::object {
             std::string a(aad), d(data);
             if (d.size() > kRecordBytes) throw_error(ErrorKind::kConfig, "[aead] a record holds at most 64 KiB");
             const uint8_t* t = bytes_of(tag, kTagBytes, "tag");
             if (!c.open(static_cast<RecordStream>(stream & 1), reinterpret_cast<const uint8_t*>(a.data()), a.size(),
                         reinterpret_cast<uint8_t*>(&d[0]), d.size(), t)) {
               return py::none();
             }
             return as_bytes(d);
           },
           py::arg("stream"), py::arg("aad"), py::arg("data"), py::arg("tag"));
  m.def("record_seconds_per_byte", &seconds_per_byte, py::arg("mode"), py::arg("open"),
        py::arg("total_bytes") = size_t(256) << 20, py::arg("repeats") = 3);
}

}  // namespace mccl
