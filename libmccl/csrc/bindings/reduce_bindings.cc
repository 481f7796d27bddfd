// Exposes the reduction kernels to Python so tests can check them against torch.
// Pointers are plain integers (tensor.data_ptr()); counts are elements. mccl::Error
// becomes the matching mccl_common.errors class through the module-wide translator
// (engine_bindings.cc).
#include "reduce_bindings.h"

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/errors.h"
#include "reduce/reduce.h"

namespace py = pybind11;

namespace mccl {
namespace {

void check_buffer(uintptr_t ptr, size_t count, const char* name) {
  if (ptr == 0 && count > 0)
    throw_error(ErrorKind::kConfig, std::string("[reduce] ") + name +
                                        " is a null pointer for a non-empty buffer; pass tensor.data_ptr()");
}

DType to_dtype(int code) {
  if (!dtype_is_valid(code))
    throw_error(ErrorKind::kConfig, "[reduce] unknown dtype code " + std::to_string(code) +
                                        "; use the values of _core.DType");
  return static_cast<DType>(code);
}

ReduceOp to_op(int code) {
  if (!reduce_op_is_valid(code))
    throw_error(ErrorKind::kConfig, "[reduce] unknown reduce op code " + std::to_string(code) +
                                        "; use the values of _core.ReduceOp");
  return static_cast<ReduceOp>(code);
}

}  // namespace

void register_reduce_bindings(py::module_& m) {
  m.def(
      "reduce_inplace",
      [](uintptr_t in_ptr, uintptr_t inout_ptr, size_t count, int dtype, int op) {
        check_buffer(in_ptr, count, "in_ptr");
        check_buffer(inout_ptr, count, "inout_ptr");
        ReduceFn fn = reduce_fn(to_dtype(dtype), to_op(op));
        py::gil_scoped_release nogil;
        fn(reinterpret_cast<const void*>(in_ptr), reinterpret_cast<void*>(inout_ptr), count);
      },
      py::arg("in_ptr"), py::arg("inout_ptr"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      "inout[i] = op(inout[i], in[i]) for `count` elements (AVG reduces as SUM).");
  m.def(
      "finalize_avg",
      [](uintptr_t ptr, size_t count, int dtype, size_t divisor) {
        check_buffer(ptr, count, "ptr");
        const DType t = to_dtype(dtype);
        py::gil_scoped_release nogil;
        finalize_avg(reinterpret_cast<void*>(ptr), count, t, divisor);
      },
      py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("divisor"),
      "Divide `count` elements by `divisor` (integers truncate toward zero).");
  m.def(
      "reduce_supported",
      [](int dtype, int op) { return reduce_supported(static_cast<DType>(dtype), static_cast<ReduceOp>(op)); },
      py::arg("dtype"), py::arg("op"));
}

}  // namespace mccl
