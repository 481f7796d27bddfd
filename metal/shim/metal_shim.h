// Lets metal/reduce.metal compile as C++17 so its kernels can run, one emulated GPU
// thread at a time, on any machine with a C++ compiler (see metal/tests/kernel_check.cc).
//
// It covers exactly what reduce.metal uses, nothing more:
//   - address-space and function qualifiers (`kernel`, `device`, `constant`) vanish;
//   - argument attributes ([[buffer(i)]], [[thread_position_in_grid]]) become
//     [[maybe_unused]], so the source's attribute syntax is kept untouched;
//   - `half` and `bfloat` are 16-bit storage structs converting through float32 with
//     round-to-nearest-even (libmccl/csrc/core/half.h), explicit conversions only, so a
//     kernel that forgets to widen to float does not compile here either;
//   - `as_type<T>` is a same-size bit cast;
//   - the kernel instantiation macros register each kernel under its host name in a
//     table the checker iterates, instead of emitting [[host_name]] instantiations.
//
// Include it LAST, after every standard header: the macros below would otherwise
// rewrite identifiers inside those headers.
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/half.h"

#define MCCL_METAL_SHIM 1
#define __HAVE_BFLOAT__ 1

typedef unsigned int uint;
typedef unsigned short ushort;

struct half {
  uint16_t bits;
  half() = default;
  explicit half(float f) : bits(mccl::float_to_half(f)) {}
  explicit operator float() const { return mccl::half_to_float(bits); }
};

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  explicit bfloat(float f) : bits(mccl::float_to_bfloat16(f)) {}
  explicit operator float() const { return mccl::bfloat16_to_float(bits); }
};

template <typename To, typename From>
To as_type(From from) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs types of the same size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

#define kernel
#define device
#define constant const
#define buffer(index) maybe_unused
#define thread_position_in_grid maybe_unused

namespace mccl_shim {

// One emulated thread of a kernel: (buffers..., thread_position_in_grid).
struct ReduceKernel {
  std::string name;
  std::function<void(const void* in, void* inout, uint n, uint gid)> thread;
};
struct FinalizeKernel {
  std::string name;
  std::function<void(void* inout, uint n, uint divisor, uint gid)> thread;
};

inline std::vector<ReduceKernel>& reduce_kernels() {
  static std::vector<ReduceKernel> table;
  return table;
}
inline std::vector<FinalizeKernel>& finalize_kernels() {
  static std::vector<FinalizeKernel> table;
  return table;
}

struct Registrar {
  explicit Registrar(ReduceKernel k) { reduce_kernels().push_back(std::move(k)); }
  explicit Registrar(FinalizeKernel k) { finalize_kernels().push_back(std::move(k)); }
};

}  // namespace mccl_shim

#define MCCL_SHIM_CAT2(a, b) a##b
#define MCCL_SHIM_CAT(a, b) MCCL_SHIM_CAT2(a, b)

#define MCCL_INSTANTIATE_REDUCE(name, T, Op)                                               \
  static const mccl_shim::Registrar MCCL_SHIM_CAT(mccl_shim_reg_, __COUNTER__){            \
      mccl_shim::ReduceKernel{name, [](const void* in, void* inout, uint n, uint gid) {    \
                                reduce_kernel<T, Op>(static_cast<const T*>(in),            \
                                                     static_cast<T*>(inout), n, gid);      \
                              }}};

#define MCCL_INSTANTIATE_FINALIZE(name, T)                                                 \
  static const mccl_shim::Registrar MCCL_SHIM_CAT(mccl_shim_reg_, __COUNTER__){            \
      mccl_shim::FinalizeKernel{name, [](void* inout, uint n, uint divisor, uint gid) {    \
                                  finalize_avg_kernel<T>(static_cast<T*>(inout), n, divisor, gid); \
                                }}};
