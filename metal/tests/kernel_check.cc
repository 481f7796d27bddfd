// Runs every kernel of metal/reduce.metal on the CPU through metal/shim and compares
// the results, bit for bit (NaN as "is NaN"), with the CPU reduction path
// (mccl::reduce_fn / mccl::finalize_avg). Also checks that the set of kernels matches
// the CPU path's supported (dtype, op) pairs for the Metal dtypes. Exit status 0 only
// when everything matches; every mismatch is printed.
//
// Build: the CMake target metal_kernel_check, or directly (tests/test_metal_kernels.py):
//   c++ -std=c++17 -Imetal -Ilibmccl/csrc metal/tests/kernel_check.cc
//       libmccl/csrc/reduce/reduce*.cc libmccl/csrc/core/dtype.cc libmccl/csrc/core/errors.cc
// On x86-64 with F16C the CPU path converts float16 in hardware while the shim's `half`
// uses the portable code of half.h, so this also cross-checks the two.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "reduce/reduce.h"

// The shim must come after every standard header (it defines keyword macros).
#include "shim/metal_shim.h"
#include "reduce.metal"

namespace {

// Threads per threadgroup of the emulated dispatch: grids are rounded up to it, so the
// kernels' bounds checks are exercised on every length that is not a multiple.
constexpr uint kThreadgroup = 256;
// Elements after the buffer end that no kernel may touch.
constexpr size_t kGuard = 64;

struct MetalDType {
  mccl::DType dtype;
  const char* name;
};
const MetalDType kDTypes[] = {
    {mccl::DType::kFloat32, "float32"},
    {mccl::DType::kFloat16, "float16"},
    {mccl::DType::kBFloat16, "bfloat16"},
    {mccl::DType::kInt32, "int32"},
};

struct MetalOp {
  mccl::ReduceOp op;
  const char* name;
};
// AVG has no kernel of its own: it is the SUM kernel followed by finalize_avg.
const MetalOp kOps[] = {
    {mccl::ReduceOp::kSum, "sum"},         {mccl::ReduceOp::kMin, "min"},
    {mccl::ReduceOp::kMax, "max"},         {mccl::ReduceOp::kProduct, "product"},
    {mccl::ReduceOp::kBand, "band"},       {mccl::ReduceOp::kBor, "bor"},
    {mccl::ReduceOp::kBxor, "bxor"},
};

const size_t kLengths[] = {0, 1, 7, 255, 256, 257, 4099};

int g_failures = 0;
int g_cases = 0;

void fail(const std::string& what) {
  if (++g_failures <= 40) std::fprintf(stderr, "MISMATCH %s\n", what.c_str());
}

bool is_float(mccl::DType t) { return t != mccl::DType::kInt32; }

bool element_is_nan(mccl::DType t, const unsigned char* p) {
  switch (t) {
    case mccl::DType::kFloat32: {
      uint32_t b;
      std::memcpy(&b, p, 4);
      return (b & 0x7fffffffu) > 0x7f800000u;
    }
    case mccl::DType::kFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return (b & 0x7fffu) > 0x7c00u;
    }
    case mccl::DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return (b & 0x7fffu) > 0x7f80u;
    }
    default:
      return false;
  }
}

// Random contents: for floats, a mix of raw bit patterns (every class: subnormal, inf,
// NaN), ordinary magnitudes, and exact special values.
std::vector<unsigned char> random_buffer(mccl::DType t, size_t n, std::mt19937& rng) {
  const size_t size = mccl::dtype_size(t);
  std::vector<unsigned char> buf((n + kGuard) * size);
  std::uniform_int_distribution<uint32_t> bits;
  std::normal_distribution<float> normal(0.0f, 8.0f);
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 65504.0f, 65520.0f, 3.0e38f,
                            1e-40f, -1e-40f, 6e-8f, INFINITY, -INFINITY, NAN, -NAN};
  for (size_t i = 0; i < n + kGuard; ++i) {
    const uint32_t r = bits(rng);
    float f = normal(rng);
    if (r % 4 == 0) f = specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
    unsigned char* p = buf.data() + i * size;
    if (!is_float(t) || r % 4 == 1) {
      const uint32_t raw = bits(rng);
      std::memcpy(p, &raw, size);
    } else if (t == mccl::DType::kFloat32) {
      std::memcpy(p, &f, 4);
    } else {
      const uint16_t h = t == mccl::DType::kFloat16 ? mccl::float_to_half(f) : mccl::float_to_bfloat16(f);
      std::memcpy(p, &h, 2);
    }
  }
  return buf;
}

void compare(const std::string& label, mccl::DType t, const std::vector<unsigned char>& want,
             const std::vector<unsigned char>& got, size_t n) {
  ++g_cases;
  const size_t size = mccl::dtype_size(t);
  for (size_t i = 0; i < n + kGuard; ++i) {
    const unsigned char* w = want.data() + i * size;
    const unsigned char* g = got.data() + i * size;
    if (i >= n) {  // guard elements: untouched by both paths, so bytes must agree
      if (std::memcmp(w, g, size) != 0) return fail(label + ": wrote past the end at element " + std::to_string(i));
      continue;
    }
    if (element_is_nan(t, w) && element_is_nan(t, g)) continue;
    if (std::memcmp(w, g, size) != 0) {
      uint64_t wb = 0, gb = 0;
      std::memcpy(&wb, w, size);
      std::memcpy(&gb, g, size);
      char msg[160];
      std::snprintf(msg, sizeof msg, ": element %zu of %zu: cpu bits %#llx, metal bits %#llx", i, n,
                    static_cast<unsigned long long>(wb), static_cast<unsigned long long>(gb));
      return fail(label + msg);
    }
  }
}

void dispatch_reduce(const mccl_shim::ReduceKernel& k, const void* in, void* inout, size_t n) {
  const uint grid = static_cast<uint>((n + kThreadgroup - 1) / kThreadgroup * kThreadgroup);
  for (uint gid = 0; gid < grid; ++gid) k.thread(in, inout, static_cast<uint>(n), gid);
}

void dispatch_finalize(const mccl_shim::FinalizeKernel& k, void* inout, size_t n, uint divisor) {
  const uint grid = static_cast<uint>((n + kThreadgroup - 1) / kThreadgroup * kThreadgroup);
  for (uint gid = 0; gid < grid; ++gid) k.thread(inout, static_cast<uint>(n), divisor, gid);
}

const mccl_shim::ReduceKernel* find_reduce(const std::string& name) {
  for (const auto& k : mccl_shim::reduce_kernels())
    if (k.name == name) return &k;
  return nullptr;
}

const mccl_shim::FinalizeKernel* find_finalize(const std::string& name) {
  for (const auto& k : mccl_shim::finalize_kernels())
    if (k.name == name) return &k;
  return nullptr;
}

}  // namespace

int main() {
  std::mt19937 rng(20240229);
  std::set<std::string> checked;

  for (const MetalDType& d : kDTypes) {
    for (const MetalOp& o : kOps) {
      const std::string name = std::string("mccl_reduce_") + o.name + "_" + d.name;
      const mccl_shim::ReduceKernel* k = find_reduce(name);
      const bool cpu = mccl::reduce_supported(d.dtype, o.op);
      if (!k) {
        if (cpu) fail(name + ": the CPU path supports it but no Metal kernel exists");
        continue;
      }
      if (!cpu) {
        fail(name + ": Metal kernel for a pair the CPU path rejects");
        continue;
      }
      checked.insert(name);
      mccl::ReduceFn fn = mccl::reduce_fn(d.dtype, o.op);
      for (size_t n : kLengths) {
        const auto in = random_buffer(d.dtype, n, rng);
        const auto start = random_buffer(d.dtype, n, rng);
        auto want = start, got = start;
        fn(in.data(), want.data(), n);
        dispatch_reduce(*k, in.data(), got.data(), n);
        compare(name + " n=" + std::to_string(n), d.dtype, want, got, n);
      }
    }

    const std::string name = std::string("mccl_finalize_avg_") + d.name;
    const mccl_shim::FinalizeKernel* k = find_finalize(name);
    if (!k) {
      fail(name + ": missing");
      continue;
    }
    checked.insert(name);
    for (uint divisor : {1u, 2u, 3u, 7u, 12u}) {
      for (size_t n : kLengths) {
        const auto start = random_buffer(d.dtype, n, rng);
        auto want = start, got = start;
        mccl::finalize_avg(want.data(), n, d.dtype, divisor);
        dispatch_finalize(*k, got.data(), n, divisor);
        compare(name + " divisor=" + std::to_string(divisor) + " n=" + std::to_string(n), d.dtype, want,
                got, n);
      }
    }
  }

  // A kernel under a name nothing looks up is dead code or a typo in its host name.
  for (const auto& k : mccl_shim::reduce_kernels())
    if (!checked.count(k.name)) fail(k.name + ": registered but not an expected mccl_reduce_<op>_<dtype> name");
  for (const auto& k : mccl_shim::finalize_kernels())
    if (!checked.count(k.name)) fail(k.name + ": registered but not an expected mccl_finalize_avg_<dtype> name");

  if (g_failures) {
    std::fprintf(stderr, "metal kernel check FAILED: %d mismatches in %d cases\n", g_failures, g_cases);
    return 1;
  }
  std::printf("metal kernel check passed: %zu kernels, %d cases, results equal to the CPU path\n",
              checked.size(), g_cases);
  return 0;
}
