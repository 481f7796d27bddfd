#include "compress/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "core/half.h"

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace mccl {

namespace {

// The codec's loops are auto-vectorised, once for the baseline ISA (SSE2 on x86-64, NEON on
// arm64) and, on x86-64 ELF, once more for AVX2 picked at load time (ifunc), as the
// reductions are (reduce/reduce.cc). Both clones compute the same IEEE operations in the same
// order (no FMA: AVX2 does not imply it, and codec.cc builds with -ffp-contract=off), so a
// rank with AVX2 and one without encode and decode the same bits.
#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__)
#define MCCL_CODEC_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MCCL_CODEC_CLONES
#endif

template <float (*From)(uint16_t)>
MCCL_CODEC_CLONES void widen(const uint16_t* __restrict p, size_t n, float* __restrict v) {
  for (size_t i = 0; i < n; ++i) v[i] = From(p[i]);
}

// Block-wise loads of 16-bit inputs into a float buffer keep the quantizer's loops on plain
// floats; float32 input is read in place.
void load_block(DType dt, const void* in, size_t begin, size_t n, float* v) {
  switch (dt) {
    case DType::kBFloat16: return widen<bfloat16_to_float>(static_cast<const uint16_t*>(in) + begin, n, v);
    case DType::kFloat16: return widen<half_to_float>(static_cast<const uint16_t*>(in) + begin, n, v);
    default: std::memcpy(v, static_cast<const float*>(in) + begin, n * sizeof(float));
  }
}

[[noreturn]] void not_applicable(Codec k, DType dt) {
  throw_error(ErrorKind::kGeneric, std::string("[compress] internal error: codec ") + codec_name(k) +
                                       " does not encode " + dtype_name(dt));
}

// y + 1.5 * 2^23 rounds y (|y| <= 2^22) to an integer, nearest-even, held in the sum's low
// mantissa bits: its low byte is round(y) as a two's-complement int8 for |y| <= 127, and
// (sum - 1.5 * 2^23) is round(y) as a float. Plain IEEE additions (no float->int conversion,
// defined for every input, NaN included), so the loop vectorises on every ISA.
constexpr float kRoundMagic = 12582912.f;
// Below this largest magnitude 127 / amax would overflow to infinity: such a block (every
// value under 1e-36) is sent as zeros and, with feedback, carried whole to the next op.
constexpr float kTinyAmax = 0x1p-120f;

// One int8 block of n <= kInt8Block values, x[i] (+ residual[i]): its scale and codes, and
// what the codes could not carry back into the residual. Loops without a float reduction or a
// data-dependent branch, so they vectorise without -ffast-math: the largest magnitude is an
// integer max over the bits with the sign cleared (ordered as the floats are, and above every
// finite value for an infinity or a NaN). A block holding a NaN or an infinity gets a NaN scale
// (it decodes to NaN) and carries nothing forward: a NaN kept in the residual would poison
// every later op of the buffer.
template <bool kFeedback>
MCCL_CODEC_CLONES void quantize(const float* __restrict x, size_t n, uint8_t* __restrict scales,
                                int8_t* __restrict codes, float* __restrict residual) {
  float v[kInt8Block];
  for (size_t begin = 0; begin < n; begin += kInt8Block) {
    const size_t len = std::min(kInt8Block, n - begin);
    const float* xb = x + begin;
    float* rb = kFeedback ? residual + begin : nullptr;
    int8_t* qb = codes + begin;
    const float* src = xb;
    int32_t top = 0;
    if (kFeedback) {
      for (size_t i = 0; i < len; ++i) {
        v[i] = xb[i] + rb[i];
        top = std::max(top, static_cast<int32_t>(float_bits(v[i]) & 0x7fffffffu));
      }
      src = v;
    } else {
      for (size_t i = 0; i < len; ++i) top = std::max(top, static_cast<int32_t>(float_bits(xb[i]) & 0x7fffffffu));
    }
    const bool finite = top < 0x7f800000;
    const float amax = bits_float(static_cast<uint32_t>(top));
    const bool tiny = amax < kTinyAmax;
    const float scale = !finite ? std::numeric_limits<float>::quiet_NaN() : tiny ? 0.f : amax / 127.f;
    const float inv = finite && !tiny ? 127.f / amax : 0.f;
    std::memcpy(scales + begin / kInt8Block * sizeof(float), &scale, sizeof scale);
    for (size_t i = 0; i < len; ++i) {
      const float t = src[i] * inv + kRoundMagic;
      qb[i] = static_cast<int8_t>(static_cast<uint8_t>(float_bits(t)));
      if (kFeedback) rb[i] = src[i] - (t - kRoundMagic) * scale;
    }
    if (kFeedback && !finite) std::memset(rb, 0, len * sizeof(float));
  }
}

// Elements [0, n) of `in` (dtype dt) into `scales` and `codes`, block by block.
void encode_int8(DType dt, const void* in, size_t n, uint8_t* scales, int8_t* codes, float* residual) {
  if (dt == DType::kFloat32) {
    const float* x = static_cast<const float*>(in);
    return residual ? quantize<true>(x, n, scales, codes, residual) : quantize<false>(x, n, scales, codes, nullptr);
  }
  // 16-bit input: widened a stretch of blocks at a time, on the stack.
  constexpr size_t kStretch = 16 * kInt8Block;
  float v[kStretch];
  for (size_t begin = 0; begin < n; begin += kStretch) {
    const size_t len = std::min(kStretch, n - begin);
    load_block(dt, in, begin, len, v);
    uint8_t* s = scales + begin / kInt8Block * sizeof(float);
    if (residual) {
      quantize<true>(v, len, s, codes + begin, residual + begin);
    } else {
      quantize<false>(v, len, s, codes + begin, nullptr);
    }
  }
}

inline float scale_of(const uint8_t* scales, size_t b) {
  float s;
  std::memcpy(&s, scales + b * sizeof(float), sizeof s);
  return s;
}

// acc[i] += code[i] * scale of its block, or (kAdd false) out[i] = code[i] * scale.
template <bool kAdd>
MCCL_CODEC_CLONES void dequantize(const uint8_t* __restrict scales, const int8_t* __restrict codes, size_t n,
                                  float* __restrict out) {
  const size_t nb = (n + kInt8Block - 1) / kInt8Block;
  for (size_t b = 0; b < nb; ++b) {
    const size_t begin = b * kInt8Block, len = std::min(kInt8Block, n - begin);
    const float s = scale_of(scales, b);
    const int8_t* q = codes + begin;
    float* o = out + begin;
    for (size_t i = 0; i < len; ++i) {
      const float d = static_cast<float>(q[i]) * s;
      o[i] = kAdd ? o[i] + d : d;
    }
  }
}

template <uint16_t (*To)(float), float (*From)(uint16_t)>
MCCL_CODEC_CLONES void encode_16(const float* __restrict v, size_t n, uint16_t* __restrict o,
                                 float* __restrict residual) {
  if (residual) {
    for (size_t i = 0; i < n; ++i) {
      const float x = v[i] + residual[i];
      const uint16_t h = To(x);
      const uint32_t d = float_bits(x - From(h));
      // An overflow to infinity (fp16 past 65504) or a NaN carries nothing forward. A bit
      // select, not a branch, so the loop vectorises (core/half.h says why).
      residual[i] = bits_float(pick((d & 0x7fffffffu) < 0x7f800000u, d, 0u));
      o[i] = h;
    }
  } else {
    for (size_t i = 0; i < n; ++i) o[i] = To(v[i]);
  }
}

#if defined(__x86_64__) && defined(__ELF__) && defined(__GNUC__)
#define MCCL_CODEC_F16C 1
// float32 -> float16 eight at a time with F16C (round to nearest-even, as float_to_half),
// every NaN then made float_to_half's (sign | 0x7e00, F16C keeps part of the payload), so
// the bits are those of the portable loop; the tail goes through it.
__attribute__((target("avx2,f16c"))) void encode_fp16_f16c(const float* __restrict v, size_t n,
                                                           uint16_t* __restrict o, float* __restrict residual) {
  const __m128i sign = _mm_set1_epi16(static_cast<short>(0x8000)), qnan = _mm_set1_epi16(0x7e00);
  const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(v + i);
    if (residual) x = _mm256_add_ps(x, _mm256_loadu_ps(residual + i));
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i nan32 = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m128i nan16 = _mm_packs_epi32(_mm256_castsi256_si128(nan32), _mm256_extracti128_si256(nan32, 1));
    h = _mm_or_si128(_mm_andnot_si128(nan16, h), _mm_and_si128(nan16, _mm_or_si128(_mm_and_si128(h, sign), qnan)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), h);
    if (residual) {
      // What the code dropped; nothing where the code is not finite (overflow, NaN).
      const __m256 d = _mm256_sub_ps(x, _mm256_cvtph_ps(h));
      const __m256i db = _mm256_castps_si256(d);
      const __m256i fin = _mm256_cmpgt_epi32(inf, _mm256_and_si256(db, abs));
      _mm256_storeu_ps(residual + i, _mm256_castsi256_ps(_mm256_and_si256(db, fin)));
    }
  }
  encode_16<float_to_half, half_to_float>(v + i, n - i, o + i, residual ? residual + i : nullptr);
}

// Exact for every float16 (NaNs come out quiet with their payload, as half_to_float's).
__attribute__((target("avx2,f16c"))) void widen_fp16_f16c(const uint16_t* __restrict p, size_t n,
                                                          float* __restrict out, bool add) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
    if (add) x = _mm256_add_ps(_mm256_loadu_ps(out + i), x);
    _mm256_storeu_ps(out + i, x);
  }
  for (; i < n; ++i) out[i] = add ? out[i] + half_to_float(p[i]) : half_to_float(p[i]);
}

bool cpu_has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
// Read during static initialisation of another file it may still be false; that only
// selects the portable path, which gives the same bits.
const bool kUseF16C = cpu_has_f16c();
#endif

void encode_fp16(const float* v, size_t n, uint16_t* o, float* residual) {
#ifdef MCCL_CODEC_F16C
  if (kUseF16C) return encode_fp16_f16c(v, n, o, residual);
#endif
  encode_16<float_to_half, half_to_float>(v, n, o, residual);
}

template <float (*From)(uint16_t)>
MCCL_CODEC_CLONES void decode_add_16(const uint16_t* __restrict p, size_t n, float* __restrict acc) {
  for (size_t i = 0; i < n; ++i) acc[i] += From(p[i]);
}

template <uint16_t (*To)(float)>
MCCL_CODEC_CLONES void narrow(const float* __restrict v, size_t n, uint16_t* __restrict o) {
  for (size_t i = 0; i < n; ++i) o[i] = To(v[i]);
}

// int8 decoded to a 16-bit dtype: through float32 a stretch at a time, rounded once.
template <uint16_t (*To)(float)>
void decode_int8_16(const uint8_t* scales, const int8_t* codes, size_t n, uint16_t* out) {
  constexpr size_t kStretch = 16 * kInt8Block;
  float v[kStretch];
  for (size_t begin = 0; begin < n; begin += kStretch) {
    const size_t len = std::min(kStretch, n - begin);
    dequantize<false>(scales + begin / kInt8Block * sizeof(float), codes + begin, len, v);
    narrow<To>(v, len, out + begin);
  }
}

// Where elements [begin, ...) of an encoding of `total` elements live: int8 keeps all the
// scales first, then all the codes, so a part that starts on a block boundary is a run of
// each; bf16/fp16 are two bytes per element.
struct Span {
  uint8_t* scales;  // int8
  int8_t* codes;    // int8
  uint16_t* half;   // bf16, fp16
};

Span span_of(Codec k, const uint8_t* enc, size_t total, size_t begin) {
  uint8_t* e = const_cast<uint8_t*>(enc);
  if (k != Codec::kInt8) return {nullptr, nullptr, reinterpret_cast<uint16_t*>(e) + begin};
  if (begin % kInt8Block != 0) {
    throw_error(ErrorKind::kGeneric, "[compress] internal error: an int8 part must start on a block boundary (" +
                                         std::to_string(begin) + ")");
  }
  const size_t nb = (total + kInt8Block - 1) / kInt8Block;
  return {e + begin / kInt8Block * sizeof(float), reinterpret_cast<int8_t*>(e + nb * sizeof(float)) + begin, nullptr};
}

void check_part(size_t total, size_t begin, size_t n) {
  if (begin > total || n > total - begin) {
    throw_error(ErrorKind::kGeneric, "[compress] internal error: part [" + std::to_string(begin) + ", +" +
                                         std::to_string(n) + ") of " + std::to_string(total) + " elements");
  }
}

}  // namespace

const char* codec_name(Codec k) {
  switch (k) {
    case Codec::kOff: return "off";
    case Codec::kBf16: return "bf16";
    case Codec::kFp16: return "fp16";
    case Codec::kInt8: return "int8";
  }
  return "unknown";
}

bool parse_codec(const std::string& s, Codec* out) {
  for (int i = 0; i < kNumCodecs; ++i) {
    if (s == codec_name(static_cast<Codec>(i))) {
      *out = static_cast<Codec>(i);
      return true;
    }
  }
  return false;
}

bool codec_applies(Codec k, DType dt) {
  switch (k) {
    case Codec::kBf16:
    case Codec::kFp16: return dt == DType::kFloat32;
    case Codec::kInt8: return dt == DType::kFloat32 || dt == DType::kBFloat16 || dt == DType::kFloat16;
    default: return false;
  }
}

size_t encoded_bytes(Codec k, size_t n) {
  switch (k) {
    case Codec::kBf16:
    case Codec::kFp16: return 2 * n;
    case Codec::kInt8: return n + (n + kInt8Block - 1) / kInt8Block * sizeof(float);
    default: return 4 * n;
  }
}

void load_f32(DType dt, const void* in, size_t n, float* out) {
  load_block(dt, in, 0, n, out);
}

void encode_part(Codec k, DType dt, const void* in, size_t total, size_t begin, size_t n, uint8_t* out,
                 float* residual) {
  if (!codec_applies(k, dt)) not_applicable(k, dt);
  check_part(total, begin, n);
  const Span sp = span_of(k, out, total, begin);
  const float* x = static_cast<const float*>(in);
  switch (k) {
    case Codec::kInt8: return encode_int8(dt, in, n, sp.scales, sp.codes, residual);
    case Codec::kBf16: return encode_16<float_to_bfloat16, bfloat16_to_float>(x, n, sp.half, residual);
    case Codec::kFp16: return encode_fp16(x, n, sp.half, residual);
    default: not_applicable(k, dt);
  }
}

void encode(Codec k, DType dt, const void* in, size_t n, uint8_t* out, float* residual) {
  encode_part(k, dt, in, n, 0, n, out, residual);
}

void encode_f32(Codec k, const float* in, size_t n, uint8_t* out, float* residual) {
  encode(k, DType::kFloat32, in, n, out, residual);
}

namespace {
void decode_add_span(Codec k, const Span& sp, size_t n, float* acc) {
  switch (k) {
    case Codec::kInt8: return dequantize<true>(sp.scales, sp.codes, n, acc);
    case Codec::kBf16: return decode_add_16<bfloat16_to_float>(sp.half, n, acc);
    case Codec::kFp16:
#ifdef MCCL_CODEC_F16C
      if (kUseF16C) return widen_fp16_f16c(sp.half, n, acc, true);
#endif
      return decode_add_16<half_to_float>(sp.half, n, acc);
    default: not_applicable(k, DType::kFloat32);
  }
}
}  // namespace

void decode_add(Codec k, const uint8_t* in, size_t n, float* acc) {
  decode_add_span(k, span_of(k, in, n, 0), n, acc);
}

void decode_add_part(Codec k, const uint8_t* in, size_t total, size_t begin, size_t n, float* acc) {
  check_part(total, begin, n);
  decode_add_span(k, span_of(k, in, total, begin), n, acc);
}

void decode_part(Codec k, const uint8_t* in, size_t total, size_t begin, size_t n, DType dt, void* out) {
  if (!codec_applies(k, dt)) not_applicable(k, dt);
  check_part(total, begin, n);
  const Span sp = span_of(k, in, total, begin);
  if (k == Codec::kBf16) return widen<bfloat16_to_float>(sp.half, n, static_cast<float*>(out));
  if (k == Codec::kFp16) {
#ifdef MCCL_CODEC_F16C
    if (kUseF16C) return widen_fp16_f16c(sp.half, n, static_cast<float*>(out), false);
#endif
    return widen<half_to_float>(sp.half, n, static_cast<float*>(out));
  }
  switch (dt) {
    case DType::kBFloat16: return decode_int8_16<float_to_bfloat16>(sp.scales, sp.codes, n, static_cast<uint16_t*>(out));
    case DType::kFloat16: return decode_int8_16<float_to_half>(sp.scales, sp.codes, n, static_cast<uint16_t*>(out));
    default: return dequantize<false>(sp.scales, sp.codes, n, static_cast<float*>(out));
  }
}

void decode(Codec k, const uint8_t* in, size_t n, DType dt, void* out) {
  decode_part(k, in, n, 0, n, dt, out);
}

}  // namespace mccl
