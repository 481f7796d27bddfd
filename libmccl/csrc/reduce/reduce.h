// The one place reductions live. Every kernel has the same contract:
//   fn(in, inout, n)  ->  inout[i] = op(inout[i], in[i])  for i in [0, n)   (n elements)
// Algorithms take a Reduction: its fn to combine, its finish once on the final result
// (AVG is SUM, then a division by the number of contributions; every other op finishes
// with nothing), so no algorithm tests for AVG itself.
#pragma once
#include <cstddef>

#include "core/dtype.h"

namespace mccl {

using ReduceFn = void (*)(const void* in, void* inout, size_t n);

// Throws Error(kConfig) for combinations that make no sense (e.g. BAND on float32).
ReduceFn reduce_fn(DType dtype, ReduceOp op);
bool reduce_supported(DType dtype, ReduceOp op);

// Divide every element by `divisor` (AVG); integer types truncate toward zero.
void finalize_avg(void* buf, size_t n, DType dtype, size_t divisor);

struct Reduction {
  DType dtype;
  ReduceOp op;
  ReduceFn fn;   // the combine step (AVG: SUM's kernel)
  size_t elem;   // bytes per element

  // Throws Error(kConfig) for combinations that make no sense, as reduce_fn does.
  static Reduction of(DType dtype, ReduceOp op);
  // True if finish() does anything (only then may an algorithm need a place to call it).
  bool finishes() const { return op == ReduceOp::kAvg; }
  // Once per element of the final result, of `contributions` inputs: every rank holding
  // the same bits finishes them the same way.
  void finish(void* buf, size_t n, size_t contributions) const {
    if (finishes()) finalize_avg(buf, n, dtype, contributions);
  }
};

}  // namespace mccl
