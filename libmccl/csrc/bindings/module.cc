#include <pybind11/pybind11.h>

#include "dtype.h"
#include "reduce_bindings.h"

namespace py = pybind11;

PYBIND11_MODULE(_core, m) {
  m.doc() = "MCCL engine: bytes, dtypes and reduce ops; no torch.";
  mccl::register_reduce_bindings(m);
  m.def("dtype_size", [](int t) { return mccl::dtype_size(static_cast<mccl::DType>(t)); });
}
