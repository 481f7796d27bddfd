// Block conversions between 16-bit floats (float16, bfloat16) and float32, used by the
// reductions to widen a block of operands, combine them as float32 and round back.
// Results are those of half.h (round-to-nearest-even) on every path; on x86-64 the
// float16 conversions use the F16C instructions when the CPU has them.
#pragma once
#include <cstddef>

namespace mccl {

void half_to_float_block(const void* src, float* dst, size_t n);
void float_to_half_block(const float* src, void* dst, size_t n);
void bfloat16_to_float_block(const void* src, float* dst, size_t n);
void float_to_bfloat16_block(const float* src, void* dst, size_t n);

}  // namespace mccl
