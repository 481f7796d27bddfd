// Registers the engine's classes on _core (see docs/dev/interfaces.md section 1).
#pragma once
#include <pybind11/pybind11.h>

namespace mccl {

void register_engine_bindings(pybind11::module_& m);

}  // namespace mccl
