// Test-facing bindings of the reduction kernels (reduce.h), registered on _core.
#pragma once
#include <pybind11/pybind11.h>

namespace mccl {

// Adds _core.reduce_inplace, _core.finalize_avg and _core.reduce_supported.
void register_reduce_bindings(pybind11::module_& m);

}  // namespace mccl
