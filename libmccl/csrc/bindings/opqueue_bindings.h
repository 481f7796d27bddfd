// Registers _core.FastQueue (a client's small-op queue) and _core.FastDispatcher (mccld's
// server of one job's queues); see opqueue/*.h and docs/daemon-fastpath.md.
#pragma once
#include <pybind11/pybind11.h>

namespace mccl {

void register_opqueue_bindings(pybind11::module_& m);

}  // namespace mccl
