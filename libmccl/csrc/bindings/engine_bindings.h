// Registers the engine's classes on _core (see docs/dev/interfaces.md section 1).
#pragma once
#include <pybind11/pybind11.h>

namespace mccl {

class Communicator;

void register_engine_bindings(pybind11::module_& m);
// True once the interpreter is finalizing: a native thread must not take the GIL then.
bool python_finalizing();
// The engine communicator behind a _core.Communicator (None: null); the object owns it.
Communicator* communicator_of(pybind11::handle comm);

}  // namespace mccl
