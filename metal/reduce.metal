// Elementwise reduction kernels for Apple GPUs, the Metal twin of libmccl/csrc/reduce/reduce.cc:
//   reduce_kernel:        inout[i] = op(inout[i], in[i])   one thread per element
//   finalize_avg_kernel:  inout[i] = inout[i] / divisor    (AVG reduces as SUM first)
// Kernels are looked up by host name, "mccl_reduce_<op>_<dtype>" and
// "mccl_finalize_avg_<dtype>", with op in sum/min/max/product/band/bor/bxor and dtype in
// float32/float16/bfloat16/int32 (bitwise ops on int32 only).
//
// Results must equal the CPU path bit for bit (the checker in metal/tests enforces this
// through metal/shim), so:
// - half and bfloat are widened to float, combined, and rounded back once, as on the CPU;
// - MIN/MAX and NaN tests use integer views of the bits (as_type), which fast-math
//   cannot fold away; NaN propagates and -0.0 orders below +0.0;
// - int32 SUM/PRODUCT wrap, computed on uint.
// Buffers: 0 = in, 1 = inout, 2 = element count (finalize: 0 = inout, 1 = count,
// 2 = divisor). Dispatch at least `count` threads; extra threads return at once.

#ifndef MCCL_METAL_SHIM
#include <metal_stdlib>
using namespace metal;
#endif

// ---- bit views: NaN test and a total-order key -----------------------------------
// The key maps sign-magnitude bits onto unsigned order: negatives flipped, positives
// offset above them, so -0.0 < +0.0 and the order is the numeric one elsewhere.

inline bool mccl_is_nan(float x) { return (as_type<uint>(x) & 0x7fffffffu) > 0x7f800000u; }
inline bool mccl_is_nan(half x) { return (uint(as_type<ushort>(x)) & 0x7fffu) > 0x7c00u; }
inline bool mccl_is_nan(int) { return false; }

inline uint mccl_order_key(float x) {
  uint b = as_type<uint>(x);
  return (b & 0x80000000u) != 0u ? ~b : (b | 0x80000000u);
}
inline uint mccl_order_key(half x) {
  uint b = uint(as_type<ushort>(x));
  return (b & 0x8000u) != 0u ? (~b & 0xffffu) : (b | 0x8000u);
}
inline uint mccl_order_key(int x) { return as_type<uint>(x) ^ 0x80000000u; }

#if defined(__HAVE_BFLOAT__)
inline bool mccl_is_nan(bfloat x) { return (uint(as_type<ushort>(x)) & 0x7fffu) > 0x7f80u; }
inline uint mccl_order_key(bfloat x) {
  uint b = uint(as_type<ushort>(x));
  return (b & 0x8000u) != 0u ? (~b & 0xffffu) : (b | 0x8000u);
}
#endif

template <typename T>
inline T mccl_min(T a, T b) {
  return mccl_is_nan(a) ? a : (mccl_is_nan(b) ? b : (mccl_order_key(a) <= mccl_order_key(b) ? a : b));
}

template <typename T>
inline T mccl_max(T a, T b) {
  return mccl_is_nan(a) ? a : (mccl_is_nan(b) ? b : (mccl_order_key(a) >= mccl_order_key(b) ? a : b));
}

// ---- operators -------------------------------------------------------------------

struct SumOp {
  static float apply(float a, float b) { return a + b; }
  static half apply(half a, half b) { return half(float(a) + float(b)); }
  static int apply(int a, int b) { return as_type<int>(as_type<uint>(a) + as_type<uint>(b)); }
#if defined(__HAVE_BFLOAT__)
  static bfloat apply(bfloat a, bfloat b) { return bfloat(float(a) + float(b)); }
#endif
};

struct ProductOp {
  static float apply(float a, float b) { return a * b; }
  static half apply(half a, half b) { return half(float(a) * float(b)); }
  static int apply(int a, int b) { return as_type<int>(as_type<uint>(a) * as_type<uint>(b)); }
#if defined(__HAVE_BFLOAT__)
  static bfloat apply(bfloat a, bfloat b) { return bfloat(float(a) * float(b)); }
#endif
};

struct MinOp {
  template <typename T>
  static T apply(T a, T b) { return mccl_min(a, b); }
};

struct MaxOp {
  template <typename T>
  static T apply(T a, T b) { return mccl_max(a, b); }
};

struct BandOp {
  static int apply(int a, int b) { return a & b; }
};

struct BorOp {
  static int apply(int a, int b) { return a | b; }
};

struct BxorOp {
  static int apply(int a, int b) { return a ^ b; }
};

// Integer division truncates toward zero, like the CPU path.
struct AvgDivide {
  static float apply(float a, uint d) { return a / float(d); }
  static half apply(half a, uint d) { return half(float(a) / float(d)); }
  static int apply(int a, uint d) { return a / int(d); }
#if defined(__HAVE_BFLOAT__)
  static bfloat apply(bfloat a, uint d) { return bfloat(float(a) / float(d)); }
#endif
};

// ---- kernels ---------------------------------------------------------------------

template <typename T, typename Op>
kernel void reduce_kernel(device const T* in [[buffer(0)]],
                          device T* inout [[buffer(1)]],
                          constant uint& n [[buffer(2)]],
                          uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  inout[gid] = Op::apply(inout[gid], in[gid]);
}

template <typename T>
kernel void finalize_avg_kernel(device T* inout [[buffer(0)]],
                                constant uint& n [[buffer(1)]],
                                constant uint& divisor [[buffer(2)]],
                                uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  inout[gid] = AvgDivide::apply(inout[gid], divisor);
}

// ---- instantiations, by host name --------------------------------------------------
// The C++ shim (metal/shim/metal_shim.h) defines these two macros itself to register
// every kernel in a table; under the Metal compiler they emit named instantiations.

#ifndef MCCL_INSTANTIATE_REDUCE
#define MCCL_INSTANTIATE_REDUCE(name, T, Op)                                              \
  template [[host_name(name)]] kernel void reduce_kernel<T, Op>(                          \
      device const T* in [[buffer(0)]], device T* inout [[buffer(1)]],                    \
      constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]);
#endif

#ifndef MCCL_INSTANTIATE_FINALIZE
#define MCCL_INSTANTIATE_FINALIZE(name, T)                                                \
  template [[host_name(name)]] kernel void finalize_avg_kernel<T>(                        \
      device T* inout [[buffer(0)]], constant uint& n [[buffer(1)]],                      \
      constant uint& divisor [[buffer(2)]], uint gid [[thread_position_in_grid]]);
#endif

#define MCCL_ARITHMETIC_KERNELS(tname, T)                               \
  MCCL_INSTANTIATE_REDUCE("mccl_reduce_sum_" tname, T, SumOp)           \
  MCCL_INSTANTIATE_REDUCE("mccl_reduce_min_" tname, T, MinOp)           \
  MCCL_INSTANTIATE_REDUCE("mccl_reduce_max_" tname, T, MaxOp)           \
  MCCL_INSTANTIATE_REDUCE("mccl_reduce_product_" tname, T, ProductOp)   \
  MCCL_INSTANTIATE_FINALIZE("mccl_finalize_avg_" tname, T)

MCCL_ARITHMETIC_KERNELS("float32", float)
MCCL_ARITHMETIC_KERNELS("float16", half)
MCCL_ARITHMETIC_KERNELS("int32", int)
#if defined(__HAVE_BFLOAT__)
MCCL_ARITHMETIC_KERNELS("bfloat16", bfloat)
#endif

MCCL_INSTANTIATE_REDUCE("mccl_reduce_band_int32", int, BandOp)
MCCL_INSTANTIATE_REDUCE("mccl_reduce_bor_int32", int, BorOp)
MCCL_INSTANTIATE_REDUCE("mccl_reduce_bxor_int32", int, BxorOp)
