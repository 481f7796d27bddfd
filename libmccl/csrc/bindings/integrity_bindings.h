#pragma once
#include <pybind11/pybind11.h>

namespace mccl {
// The frame MAC's primitives, for their test vectors and their throughput measurement.
void register_integrity_bindings(pybind11::module_& m);
}  // namespace mccl
