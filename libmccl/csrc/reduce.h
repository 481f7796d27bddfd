// The one place reductions live. Every kernel has the same contract:
//   fn(in, inout, n)  ->  inout[i] = op(inout[i], in[i])  for i in [0, n)   (n elements)
// AVG reduces as SUM; the algorithm calls finalize_avg once on the final result.
#pragma once
#include <cstddef>

#include "dtype.h"

namespace mccl {

using ReduceFn = void (*)(const void* in, void* inout, size_t n);

// Throws Error(kConfig) for combinations that make no sense (e.g. BAND on float32).
ReduceFn reduce_fn(DType dtype, ReduceOp op);
bool reduce_supported(DType dtype, ReduceOp op);

// Divide every element by `divisor` (AVG); integer types truncate toward zero.
void finalize_avg(void* buf, size_t n, DType dtype, size_t divisor);

}  // namespace mccl
