#include <pybind11/pybind11.h>

#include "core/dtype.h"
#include "core/errors.h"
#include "bindings/engine_bindings.h"
#include "bindings/opqueue_bindings.h"
#include "bindings/integrity_bindings.h"
#include "bindings/compress_bindings.h"
#include "reduce_bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "MCCL engine: communicators over TCP, dtypes and reduce ops; no torch.";
  mccl::register_reduce_bindings(m);
  mccl::register_compress_bindings(m);
  mccl::register_engine_bindings(m);
  mccl::register_opqueue_bindings(m);
  mccl::register_integrity_bindings(m);
  m.def("dtype_size", [](int t) {
    if (!mccl::dtype_is_valid(t)) mccl::throw_error(mccl::ErrorKind::kConfig, "[engine] unknown dtype code " + std::to_string(t));
    return mccl::dtype_size(static_cast<mccl::DType>(t));
  });
}
