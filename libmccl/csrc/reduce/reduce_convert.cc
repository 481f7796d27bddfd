#include "reduce/reduce_convert.h"

#include <cstdint>
#include <cstring>

#include "core/half.h"

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__)
#define MCCL_HAVE_F16C_PATH 1
#include <immintrin.h>
#define MCCL_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MCCL_VECTOR_CLONES
#endif

namespace mccl {
namespace {

// Portable loops: memcpy element access (any alignment), branch-free bodies, so the
// compiler vectorises them (AVX2 clone on x86-64, NEON on arm64).
template <uint16_t (*kNarrow)(float)>
MCCL_VECTOR_CLONES void narrow_portable(const float* __restrict src, void* dst, size_t n) {
  unsigned char* __restrict out = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = kNarrow(src[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

template <float (*kWiden)(uint16_t)>
MCCL_VECTOR_CLONES void widen_portable(const void* src, float* __restrict dst, size_t n) {
  const unsigned char* __restrict in = static_cast<const unsigned char*>(src);
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    dst[i] = kWiden(h);
  }
}

#ifdef MCCL_HAVE_F16C_PATH
// F16C converts 8 values per instruction with the same rounding as half.h (checked
// for every float32 input); the tail goes through the portable code.
__attribute__((target("avx2,f16c"))) void half_to_float_f16c(const void* src, float* dst, size_t n) {
  const unsigned char* in = static_cast<const unsigned char*>(src);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i))));
  widen_portable<half_to_float>(in + 2 * i, dst + i, n - i);
}

__attribute__((target("avx2,f16c"))) void float_to_half_f16c(const float* src, void* dst, size_t n) {
  unsigned char* out = static_cast<unsigned char*>(dst);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  narrow_portable<float_to_half>(src + i, out + 2 * i, n - i);
}

bool cpu_has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
// Read during static initialisation of another file it may still be false; that only
// selects the portable path, which gives the same results.
const bool kUseF16C = cpu_has_f16c();
#endif

}  // namespace

void half_to_float_block(const void* src, float* dst, size_t n) {
#ifdef MCCL_HAVE_F16C_PATH
  if (kUseF16C) return half_to_float_f16c(src, dst, n);
#endif
  widen_portable<half_to_float>(src, dst, n);
}

void float_to_half_block(const float* src, void* dst, size_t n) {
#ifdef MCCL_HAVE_F16C_PATH
  if (kUseF16C) return float_to_half_f16c(src, dst, n);
#endif
  narrow_portable<float_to_half>(src, dst, n);
}

void bfloat16_to_float_block(const void* src, float* dst, size_t n) {
  widen_portable<bfloat16_to_float>(src, dst, n);
}

void float_to_bfloat16_block(const float* src, void* dst, size_t n) {
  narrow_portable<float_to_bfloat16>(src, dst, n);
}

}  // namespace mccl
