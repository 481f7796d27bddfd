// The compression codecs (compress/codec.h) for tests and the codec microbenchmark
// (`python -m tools.bench --codecs`), registered on _core.
#pragma once
#include <pybind11/pybind11.h>

namespace mccl {

// Adds _core.compress_encode, compress_decode, compress_decode_add, compress_encoded_bytes,
// compress_codecs and compress_block.
void register_compress_bindings(pybind11::module_& m);

}  // namespace mccl
