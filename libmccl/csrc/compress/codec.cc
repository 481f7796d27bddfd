#include "compress/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "core/half.h"

namespace mccl {

namespace {

// Block-wise loads into a float buffer keep the quantizer's loops on plain floats (they
// vectorise); kInt8Block floats fit on the stack.
void load_block(DType dt, const void* in, size_t begin, size_t n, float* v) {
  switch (dt) {
    case DType::kBFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(in) + begin;
      for (size_t i = 0; i < n; ++i) v[i] = bfloat16_to_float(p[i]);
      break;
    }
    case DType::kFloat16: {
      const uint16_t* p = static_cast<const uint16_t*>(in) + begin;
      for (size_t i = 0; i < n; ++i) v[i] = half_to_float(p[i]);
      break;
    }
    default: std::memcpy(v, static_cast<const float*>(in) + begin, n * sizeof(float));
  }
}

[[noreturn]] void not_applicable(Codec k, DType dt) {
  throw_error(ErrorKind::kGeneric, std::string("[compress] internal error: codec ") + codec_name(k) +
                                       " does not encode " + dtype_name(dt));
}

// One int8 block of n <= kInt8Block values `v` (already plus the residual): its scale and codes.
// Loops without a float reduction or a data-dependent branch, so they vectorise without
// -ffast-math: the largest magnitude is an integer max over the bits with the sign cleared
// (ordered as the floats are, and above every finite value for an infinity or a NaN).
inline void quantize_block(const float* v, size_t n, float* scale_out, int8_t* q, float* residual) {
  uint32_t top = 0;
  for (size_t i = 0; i < n; ++i) top = std::max(top, float_bits(v[i]) & 0x7fffffffu);
  const bool finite = top < 0x7f800000u;
  const float amax = bits_float(top);
  const float scale = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
  const float inv = finite && amax > 0.f ? 127.f / amax : 0.f;
  for (size_t i = 0; i < n; ++i) {
    const float y = v[i] * inv;
    const float r = std::min(127.f, std::max(-127.f, y + std::copysign(0.5f, y)));
    q[i] = static_cast<int8_t>(static_cast<int>(r));
  }
  std::memcpy(scale_out, &scale, sizeof scale);
  if (!residual) return;
  if (!finite) {
    // A non-finite block carries nothing forward: a NaN kept in the residual would poison
    // every later op of the buffer.
    std::memset(residual, 0, n * sizeof(float));
    return;
  }
  for (size_t i = 0; i < n; ++i) residual[i] = v[i] - static_cast<float>(q[i]) * scale;
}

void encode_int8(DType dt, const void* in, bool f32_in, size_t n, uint8_t* out, float* residual) {
  const size_t nb = (n + kInt8Block - 1) / kInt8Block;
  // Scales first, then the codes; the buffer need not be 4-aligned (memcpy).
  int8_t* codes = reinterpret_cast<int8_t*>(out + nb * sizeof(float));
  float v[kInt8Block];
  for (size_t b = 0; b < nb; ++b) {
    const size_t begin = b * kInt8Block, len = std::min(kInt8Block, n - begin);
    if (f32_in) {
      std::memcpy(v, static_cast<const float*>(in) + begin, len * sizeof(float));
    } else {
      load_block(dt, in, begin, len, v);
    }
    float* res = residual ? residual + begin : nullptr;
    if (res) {
      for (size_t i = 0; i < len; ++i) v[i] += res[i];
    }
    float s;
    quantize_block(v, len, &s, codes + begin, res);
    std::memcpy(out + b * sizeof(float), &s, sizeof s);
  }
}

inline float scale_of(const uint8_t* in, size_t b) {
  float s;
  std::memcpy(&s, in + b * sizeof(float), sizeof s);
  return s;
}

template <typename Store>
void decode_int8(const uint8_t* in, size_t n, Store store) {
  const size_t nb = (n + kInt8Block - 1) / kInt8Block;
  const int8_t* codes = reinterpret_cast<const int8_t*>(in + nb * sizeof(float));
  for (size_t b = 0; b < nb; ++b) {
    const size_t begin = b * kInt8Block, len = std::min(kInt8Block, n - begin);
    const float s = scale_of(in, b);
    store(begin, len, codes + begin, s);
  }
}

template <uint16_t (*To)(float), float (*From)(uint16_t)>
void encode_16(const float* v, size_t n, uint8_t* out, float* residual) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
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

void encode(Codec k, DType dt, const void* in, size_t n, uint8_t* out, float* residual) {
  if (!codec_applies(k, dt)) not_applicable(k, dt);
  switch (k) {
    case Codec::kInt8: return encode_int8(dt, in, dt == DType::kFloat32, n, out, residual);
    case Codec::kBf16:
      return encode_16<float_to_bfloat16, bfloat16_to_float>(static_cast<const float*>(in), n, out, residual);
    case Codec::kFp16:
      return encode_16<float_to_half, half_to_float>(static_cast<const float*>(in), n, out, residual);
    default: not_applicable(k, dt);
  }
}

void encode_f32(Codec k, const float* in, size_t n, uint8_t* out, float* residual) {
  encode(k, DType::kFloat32, in, n, out, residual);
}

void decode_add(Codec k, const uint8_t* in, size_t n, float* acc) {
  switch (k) {
    case Codec::kInt8:
      return decode_int8(in, n, [&](size_t begin, size_t len, const int8_t* q, float s) {
        float* a = acc + begin;
        for (size_t i = 0; i < len; ++i) a[i] += static_cast<float>(q[i]) * s;
      });
    case Codec::kBf16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) acc[i] += bfloat16_to_float(p[i]);
      return;
    }
    case Codec::kFp16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) acc[i] += half_to_float(p[i]);
      return;
    }
    default: not_applicable(k, DType::kFloat32);
  }
}

void decode(Codec k, const uint8_t* in, size_t n, DType dt, void* out) {
  if (!codec_applies(k, dt)) not_applicable(k, dt);
  if (k != Codec::kInt8) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(in);
    float* o = static_cast<float*>(out);
    if (k == Codec::kBf16) {
      for (size_t i = 0; i < n; ++i) o[i] = bfloat16_to_float(p[i]);
    } else {
      for (size_t i = 0; i < n; ++i) o[i] = half_to_float(p[i]);
    }
    return;
  }
  decode_int8(in, n, [&](size_t begin, size_t len, const int8_t* q, float s) {
    switch (dt) {
      case DType::kBFloat16: {
        uint16_t* o = static_cast<uint16_t*>(out) + begin;
        for (size_t i = 0; i < len; ++i) o[i] = float_to_bfloat16(static_cast<float>(q[i]) * s);
        break;
      }
      case DType::kFloat16: {
        uint16_t* o = static_cast<uint16_t*>(out) + begin;
        for (size_t i = 0; i < len; ++i) o[i] = float_to_half(static_cast<float>(q[i]) * s);
        break;
      }
      default: {
        float* o = static_cast<float*>(out) + begin;
        for (size_t i = 0; i < len; ++i) o[i] = static_cast<float>(q[i]) * s;
      }
    }
  });
}

}  // namespace mccl
