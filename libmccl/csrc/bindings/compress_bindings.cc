// Pointers are plain integers (tensor.data_ptr(), ndarray.ctypes.data); counts are elements.
#include "compress_bindings.h"

#include <cstdint>
#include <string>

#include "compress/codec.h"
#include "core/dtype.h"
#include "core/errors.h"

namespace py = pybind11;

namespace mccl {
namespace {

Codec to_codec(const std::string& s) {
  Codec k;
  if (!parse_codec(s, &k) || k == Codec::kOff) {
    throw_error(ErrorKind::kConfig, "[compress] unknown codec '" + s + "'; use bf16, fp16 or int8");
  }
  return k;
}

DType to_dtype(Codec k, int code) {
  if (!dtype_is_valid(code) || !codec_applies(k, static_cast<DType>(code))) {
    throw_error(ErrorKind::kConfig, std::string("[compress] codec ") + codec_name(k) +
                                        " does not encode dtype code " + std::to_string(code) +
                                        " (bf16/fp16: float32; int8: float32, bfloat16, float16)");
  }
  return static_cast<DType>(code);
}

void check(uintptr_t p, size_t n, const char* name) {
  if (p == 0 && n > 0) throw_error(ErrorKind::kConfig, std::string("[compress] ") + name + " is a null pointer");
}

}  // namespace

void register_compress_bindings(py::module_& m) {
  m.attr("compress_block") = kInt8Block;
  m.def("compress_encoded_bytes", [](const std::string& codec, size_t n) { return encoded_bytes(to_codec(codec), n); },
        py::arg("codec"), py::arg("count"), "Bytes of `count` encoded elements.");
  m.def("compress_applies", [](const std::string& codec, int dtype) {
          return dtype_is_valid(dtype) && codec_applies(to_codec(codec), static_cast<DType>(dtype));
        },
        py::arg("codec"), py::arg("dtype"), "Whether the codec encodes this dtype (the engine's choice).");
  m.def(
      "compress_encode",
      [](const std::string& codec, int dtype, uintptr_t in, size_t n, uintptr_t out, uintptr_t residual) {
        const Codec k = to_codec(codec);
        const DType dt = to_dtype(k, dtype);
        check(in, n, "in");
        check(out, n, "out");
        py::gil_scoped_release nogil;
        encode(k, dt, reinterpret_cast<const void*>(in), n, reinterpret_cast<uint8_t*>(out),
               reinterpret_cast<float*>(residual));
      },
      py::arg("codec"), py::arg("dtype"), py::arg("in_ptr"), py::arg("count"), py::arg("out_ptr"),
      py::arg("residual_ptr") = 0,
      "Encodes `count` elements into out (compress_encoded_bytes bytes); with a residual (float32, "
      "count elements) encodes in + residual and leaves the codec's error in it.");
  m.def(
      "compress_decode",
      [](const std::string& codec, uintptr_t in, size_t n, int dtype, uintptr_t out) {
        const Codec k = to_codec(codec);
        const DType dt = to_dtype(k, dtype);
        check(in, n, "in");
        check(out, n, "out");
        py::gil_scoped_release nogil;
        decode(k, reinterpret_cast<const uint8_t*>(in), n, dt, reinterpret_cast<void*>(out));
      },
      py::arg("codec"), py::arg("in_ptr"), py::arg("count"), py::arg("dtype"), py::arg("out_ptr"));
  m.def(
      "compress_decode_add",
      [](const std::string& codec, uintptr_t in, size_t n, uintptr_t acc) {
        const Codec k = to_codec(codec);
        check(in, n, "in");
        check(acc, n, "acc");
        py::gil_scoped_release nogil;
        decode_add(k, reinterpret_cast<const uint8_t*>(in), n, reinterpret_cast<float*>(acc));
      },
      py::arg("codec"), py::arg("in_ptr"), py::arg("count"), py::arg("acc_ptr"),
      "acc (float32) += the decoded elements.");
}

}  // namespace mccl
