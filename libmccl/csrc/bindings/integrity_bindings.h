#pragma once
#include <pybind11/pybind11.h>

namespace mccl {
// The frame sealing's record cipher, for its test vectors and its throughput measurement.
void register_integrity_bindings(pybind11::module_& m);
}  // namespace mccl
