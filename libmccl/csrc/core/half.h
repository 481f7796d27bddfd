// IEEE binary16 (float16) and bfloat16 <-> float32 conversions, round-to-nearest-even.
//
// The reductions compute 16-bit types in float32 and round back once per element,
// which is what torch's CPU kernels do, so a single a+b matches torch bit for bit.
// Every function is branch-free (selects, no early returns) so that loops calling
// them auto-vectorise; the Metal shim reuses them to emulate `half` and `bfloat`.
// Selects go through pick() on precomputed values: a ternary lets the compiler sink
// a float operation into a branch, and with -ftrapping-math (the default) it then
// refuses to turn that branch back into a vector blend.
#pragma once
#include <cstdint>
#include <cstring>

namespace mccl {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// c ? a : b, computed as a bit blend of two already-evaluated values.
inline uint32_t pick(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  // Normal numbers only need the exponent re-biased (15 -> 127).
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  // Inf stays inf; NaN keeps its payload and comes out quiet, as the hardware does.
  const uint32_t special = 0x7f800000u | (mant << 13) | pick(mant != 0, 0x400000u, 0u);
  // Subnormals: (1.mant * 2^-14) - 2^-14 == mant * 2^-24, exact in float32.
  const uint32_t sub = float_bits(bits_float(0x38800000u | (mant << 13)) - bits_float(0x38800000u));
  return bits_float(sign | pick(exp == 0, sub, pick(exp == 31, special, normal)));
}

inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t a = x & 0x7fffffffu;
  // Normal range: re-bias the exponent and round the 13 dropped mantissa bits to
  // nearest-even. A carry out of the mantissa correctly bumps the exponent, up to
  // 0x7c00 (inf) for values at or above 65520; larger values are clamped to inf.
  const uint32_t rounded = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
  const uint32_t normal = pick(rounded > 0x7c00u, 0x7c00u, rounded);
  // Below 2^-14 the result is a subnormal count of 2^-24 units. Adding 0.5 (whose
  // ulp is exactly 2^-24) makes the float adder round to that grid, nearest-even;
  // the low bits of the sum are then the count. A count of 0x400 is the smallest
  // normal half, so rounding up across the boundary needs no special case.
  const uint32_t sub = float_bits(bits_float(a) + 0.5f) - 0x3f000000u;
  const uint32_t finite = pick(a < 0x38800000u, sub, normal);
  // Every NaN becomes the canonical quiet NaN (torch does the same).
  const uint32_t magnitude = pick(a > 0x7f800000u, 0x7e00u, finite);
  return static_cast<uint16_t>(sign | magnitude);
}

inline float bfloat16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint16_t float_to_bfloat16(float f) {
  const uint32_t x = float_bits(f);
  // Round to nearest-even on the 16 dropped bits; a carry into the exponent is the
  // correct result (including overflow to inf).
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const bool nan = (x & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(pick(nan, (x >> 16) | 0x0040u, rounded));
}

}  // namespace mccl
