// Reduction kernels: two loop templates (elementwise, and widen-a-block for 16-bit
// floats) instantiated over a table of (element type, operator) pairs. See reduce.h
// for the contract.
//
// Design notes
// - Elements are loaded and stored with memcpy through byte pointers, so buffers at
//   any byte offset (e.g. a segment inside a receive buffer) are valid; the compiler
//   turns these into plain unaligned vector loads.
// - `in` and `inout` must not overlap (they are `__restrict`); the engine always
//   reduces a received segment into a separate destination.
// - 16-bit floats are computed in float32 and rounded back once (as torch's CPU
//   kernels do), a block at a time; bool is loaded as (byte != 0) and stored as 0/1.
// - Integer SUM/PRODUCT run in the unsigned type of the same width: signed overflow
//   is undefined behaviour in C++, unsigned wraps, and torch wraps too.
// - Float MIN/MAX propagate NaN (like torch.minimum/maximum) and order -0.0 below
//   +0.0, so the result does not depend on which rank's value arrives first.
// - Loop bodies stay branch-free (selects are bit blends) so every kernel vectorises.
#include "reduce/reduce.h"

#include <cstring>
#include <string>
#include <type_traits>

#include "core/errors.h"
#include "reduce/reduce_convert.h"

// One binary runs the AVX2 variant where the CPU has it. target_clones needs ifunc
// support (ELF); elsewhere (Apple arm64) the plain -O3 loop is auto-vectorised for NEON.
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__)
#define MCCL_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MCCL_VECTOR_CLONES
#endif

namespace mccl {
namespace {

// ---- element types: storage in the buffer, value type the operators see --------

template <class T>
struct Native {
  using Storage = T;
  using Value = T;
  static constexpr bool kWidened = false;
  static Value load(Storage s) { return s; }
  static Storage store(Value v) { return v; }
};

// 16-bit floats are widened a block at a time (reduce_convert.h), so their conversions
// run as separate tight loops (F16C on x86-64) and the float32 operator loop is shared.
struct Float16 {
  using Storage = uint16_t;
  static constexpr bool kWidened = true;
  static void widen(const void* s, float* d, size_t n) { half_to_float_block(s, d, n); }
  static void narrow(const float* s, void* d, size_t n) { float_to_half_block(s, d, n); }
};

struct BFloat16 {
  using Storage = uint16_t;
  static constexpr bool kWidened = true;
  static void widen(const void* s, float* d, size_t n) { bfloat16_to_float_block(s, d, n); }
  static void narrow(const float* s, void* d, size_t n) { float_to_bfloat16_block(s, d, n); }
};

struct Bool {
  using Storage = uint8_t;
  using Value = bool;
  static constexpr bool kWidened = false;
  static Value load(Storage s) { return s != 0; }
  static Storage store(Value v) { return static_cast<Storage>(v); }
};

// ---- operators on values -------------------------------------------------------

template <class V>
using Bits = std::conditional_t<sizeof(V) == 8, uint64_t, uint32_t>;

template <class V>
Bits<V> to_bits(V v) {
  Bits<V> b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

template <class V>
V from_bits(Bits<V> b) {
  V v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// Wrapping arithmetic: promote to an unsigned type at least as wide as `unsigned`
// (uint8 * uint8 would otherwise promote to signed int).
template <class V>
using Wide = std::common_type_t<std::make_unsigned_t<V>, unsigned>;

struct Sum {
  template <class V>
  static V apply(V a, V b) {
    if constexpr (std::is_same_v<V, bool>) return a | b;
    else if constexpr (std::is_integral_v<V>)
      return static_cast<V>(static_cast<Wide<V>>(a) + static_cast<Wide<V>>(b));
    else return a + b;
  }
};

struct Product {
  template <class V>
  static V apply(V a, V b) {
    if constexpr (std::is_same_v<V, bool>) return a & b;
    else if constexpr (std::is_integral_v<V>)
      return static_cast<V>(static_cast<Wide<V>>(a) * static_cast<Wide<V>>(b));
    else return a * b;
  }
};

// Float MIN/MAX order values by an integer key (sign-magnitude bits mapped to two's
// complement): a total order in which -0.0 < +0.0. Integer compares and blends
// vectorise; float compares under a ternary do not (see pick() in half.h). A NaN
// operand is returned as is.
template <class V>
struct FloatOrder {
  using U = Bits<V>;
  using S = std::make_signed_t<U>;
  static constexpr U kAbs = ~U{0} >> 1;
  static constexpr U kInf = static_cast<U>(sizeof(V) == 8 ? 0x7ff0000000000000ull : 0x7f800000ull);
  static S key(U b) {
    const U negative = static_cast<U>(0) - (b >> (sizeof(U) * 8 - 1));
    return static_cast<S>(b ^ (negative & kAbs));
  }
  static U blend(bool c, U a, U b) {
    const U m = static_cast<U>(0) - static_cast<U>(c);
    return (a & m) | (b & ~m);
  }
  // The smaller (kMax == false) or larger operand; NaN wins.
  template <bool kMax>
  static V pick(V a, V b) {
    const U ba = to_bits(a), bb = to_bits(b);
    const bool a_first = kMax ? key(ba) >= key(bb) : key(ba) <= key(bb);
    const U r = blend((ba & kAbs) > kInf, ba, blend((bb & kAbs) > kInf, bb, blend(a_first, ba, bb)));
    return from_bits<V>(r);
  }
};

struct Min {
  template <class V>
  static V apply(V a, V b) {
    if constexpr (std::is_integral_v<V>) return b < a ? b : a;
    else return FloatOrder<V>::template pick<false>(a, b);
  }
};

struct Max {
  template <class V>
  static V apply(V a, V b) {
    if constexpr (std::is_integral_v<V>) return a < b ? b : a;
    else return FloatOrder<V>::template pick<true>(a, b);
  }
};

struct BitAnd {
  template <class V>
  static V apply(V a, V b) { return static_cast<V>(a & b); }
};

struct BitOr {
  template <class V>
  static V apply(V a, V b) { return static_cast<V>(a | b); }
};

struct BitXor {
  template <class V>
  static V apply(V a, V b) { return static_cast<V>(a ^ b); }
};

// ---- the loops ------------------------------------------------------------------

template <class Elem, class Op>
MCCL_VECTOR_CLONES void reduce_loop(const void* in, void* inout, size_t n) {
  using S = typename Elem::Storage;
  const unsigned char* __restrict src = static_cast<const unsigned char*>(in);
  unsigned char* __restrict dst = static_cast<unsigned char*>(inout);
  for (size_t i = 0; i < n; ++i) {
    S a, b;
    std::memcpy(&a, dst + i * sizeof(S), sizeof(S));
    std::memcpy(&b, src + i * sizeof(S), sizeof(S));
    const S r = Elem::store(Op::apply(Elem::load(a), Elem::load(b)));
    std::memcpy(dst + i * sizeof(S), &r, sizeof(S));
  }
}

template <class Elem, class Div>
MCCL_VECTOR_CLONES void divide_loop(void* buf, size_t n, Div divisor) {
  using S = typename Elem::Storage;
  unsigned char* __restrict p = static_cast<unsigned char*>(buf);
  for (size_t i = 0; i < n; ++i) {
    S a;
    std::memcpy(&a, p + i * sizeof(S), sizeof(S));
    const S r = Elem::store(static_cast<typename Elem::Value>(Elem::load(a) / divisor));
    std::memcpy(p + i * sizeof(S), &r, sizeof(S));
  }
}

// Widened types: blocks of this many elements (two float blocks, 4 KiB, stay in L1).
constexpr size_t kBlock = 512;

template <class Op>
MCCL_VECTOR_CLONES void combine_floats(float* __restrict acc, const float* __restrict x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = Op::apply(acc[i], x[i]);
}

template <class Elem, class Op>
void reduce_widened(const void* in, void* inout, size_t n) {
  const unsigned char* src = static_cast<const unsigned char*>(in);
  unsigned char* dst = static_cast<unsigned char*>(inout);
  float acc[kBlock], x[kBlock];
  for (size_t done = 0; done < n; done += kBlock) {
    const size_t m = n - done < kBlock ? n - done : kBlock;
    const size_t at = done * sizeof(typename Elem::Storage);
    Elem::widen(dst + at, acc, m);
    Elem::widen(src + at, x, m);
    combine_floats<Op>(acc, x, m);
    Elem::narrow(acc, dst + at, m);
  }
}

MCCL_VECTOR_CLONES void divide_floats(float* __restrict acc, size_t n, float divisor) {
  for (size_t i = 0; i < n; ++i) acc[i] = acc[i] / divisor;
}

template <class Elem>
void divide_widened(void* buf, size_t n, float divisor) {
  unsigned char* p = static_cast<unsigned char*>(buf);
  float acc[kBlock];
  for (size_t done = 0; done < n; done += kBlock) {
    const size_t m = n - done < kBlock ? n - done : kBlock;
    const size_t at = done * sizeof(typename Elem::Storage);
    Elem::widen(p + at, acc, m);
    divide_floats(acc, m, divisor);
    Elem::narrow(acc, p + at, m);
  }
}

// ---- the table ------------------------------------------------------------------

// One row per element type, in ReduceOp order; nullptr marks an undefined pair.
struct Row {
  ReduceFn fn[kNumReduceOps];
};

// nullptr for a pair that is not defined; the kernel is never instantiated for it.
template <class Elem, class Op, bool kDefined = true>
constexpr ReduceFn entry() {
  if constexpr (!kDefined) return nullptr;
  else if constexpr (Elem::kWidened) return &reduce_widened<Elem, Op>;
  else return &reduce_loop<Elem, Op>;
}

template <class Elem, bool kBitwise, bool kAvg>
constexpr Row make_row() {
  return Row{{
      entry<Elem, Sum>(),                  // SUM
      entry<Elem, Sum, kAvg>(),            // AVG: reduces as SUM, then finalize_avg
      entry<Elem, Min>(),                  // MIN
      entry<Elem, Max>(),                  // MAX
      entry<Elem, Product>(),              // PRODUCT
      entry<Elem, BitAnd, kBitwise>(),     // BAND
      entry<Elem, BitOr, kBitwise>(),      // BOR
      entry<Elem, BitXor, kBitwise>(),     // BXOR
  }};
}

// Indexed by DType. Floats have no bitwise ops; the mean of booleans is not a
// boolean, so bool has no AVG (torch's NCCL backend refuses it as well).
const Row kTable[kNumDTypes] = {
    make_row<Native<float>, false, true>(),     // float32
    make_row<Native<double>, false, true>(),    // float64
    make_row<Float16, false, true>(),           // float16
    make_row<BFloat16, false, true>(),          // bfloat16
    make_row<Native<int8_t>, true, true>(),     // int8
    make_row<Native<uint8_t>, true, true>(),    // uint8
    make_row<Native<int32_t>, true, true>(),    // int32
    make_row<Native<int64_t>, true, true>(),    // int64
    make_row<Bool, true, false>(),              // bool
};

void check_valid(DType dtype, ReduceOp op) {
  if (!dtype_is_valid(static_cast<int>(dtype)))
    throw_error(ErrorKind::kConfig,
                "[reduce] unknown dtype code " + std::to_string(static_cast<int>(dtype)) +
                    ", caller and engine disagree on the dtype table; rebuild libmccl");
  if (!reduce_op_is_valid(static_cast<int>(op)))
    throw_error(ErrorKind::kConfig,
                "[reduce] unknown reduce op code " + std::to_string(static_cast<int>(op)) +
                    ", caller and engine disagree on the op table; rebuild libmccl");
}

}  // namespace

bool reduce_supported(DType dtype, ReduceOp op) {
  if (!dtype_is_valid(static_cast<int>(dtype)) || !reduce_op_is_valid(static_cast<int>(op)))
    return false;
  return kTable[static_cast<int>(dtype)].fn[static_cast<int>(op)] != nullptr;
}

ReduceFn reduce_fn(DType dtype, ReduceOp op) {
  check_valid(dtype, op);
  ReduceFn fn = kTable[static_cast<int>(dtype)].fn[static_cast<int>(op)];
  if (fn == nullptr) {
    const std::string what = std::string(reduce_op_name(op)) + " is not defined for " + dtype_name(dtype);
    const bool is_float = dtype == DType::kFloat32 || dtype == DType::kFloat64 ||
                          dtype == DType::kFloat16 || dtype == DType::kBFloat16;
    const std::string fix = is_float ? "bitwise ops need an integer or bool tensor; use SUM/MIN/MAX/PRODUCT/AVG "
                                       "or view the tensor as an integer type"
                                     : "the mean of booleans is not a boolean; cast to a float type first";
    throw_error(ErrorKind::kConfig, "[reduce] " + what + "; " + fix);
  }
  return fn;
}

Reduction Reduction::of(DType dtype, ReduceOp op) {
  return Reduction{dtype, op, reduce_fn(dtype, op), dtype_size(dtype)};
}

void finalize_avg(void* buf, size_t n, DType dtype, size_t divisor) {
  check_valid(dtype, ReduceOp::kAvg);
  if (divisor == 0)
    throw_error(ErrorKind::kConfig, "[reduce] AVG divisor is 0; the group size must be at least 1");
  if (n == 0 || divisor == 1) return;
  switch (dtype) {
    // Floats divide (not multiply by a reciprocal) so the result equals torch's sum / n.
    case DType::kFloat32: return divide_loop<Native<float>>(buf, n, static_cast<float>(divisor));
    case DType::kFloat64: return divide_loop<Native<double>>(buf, n, static_cast<double>(divisor));
    case DType::kFloat16: return divide_widened<Float16>(buf, n, static_cast<float>(divisor));
    case DType::kBFloat16: return divide_widened<BFloat16>(buf, n, static_cast<float>(divisor));
    // C++ integer division truncates toward zero.
    case DType::kInt8: return divide_loop<Native<int8_t>>(buf, n, static_cast<int64_t>(divisor));
    case DType::kUInt8: return divide_loop<Native<uint8_t>>(buf, n, static_cast<uint64_t>(divisor));
    case DType::kInt32: return divide_loop<Native<int32_t>>(buf, n, static_cast<int64_t>(divisor));
    case DType::kInt64: return divide_loop<Native<int64_t>>(buf, n, static_cast<int64_t>(divisor));
    case DType::kBool:
      reduce_fn(dtype, ReduceOp::kAvg);  // throws the ConfigError that explains why
      return;
  }
}

}  // namespace mccl
