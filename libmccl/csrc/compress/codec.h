// Compression codecs for reducing collectives (MCCL_COMPRESSION): what a contribution or a
// reduced result looks like on the wire. A codec sits between the reduction and the
// transport: the algorithms encode before they send and decode after they receive; the
// transport still moves opaque bytes and reduce/ still combines plain elements.
//
// Every function is deterministic (no threads, no fused multiply-add choices left to the
// caller's thread), so ranks that decode the same bytes hold the same bits.
//
//   bf16, fp16  float32 values rounded to nearest-even 16-bit floats (2 bytes/element)
//   int8        blocks of kInt8Block elements, one float32 scale (absmax / 127) per block and
//               one signed byte per element, rounded to nearest (1 + 4/kInt8Block bytes/element);
//               a block holding a NaN or infinity decodes to NaN throughout, so a non-finite
//               gradient stays visible (AMP's scaler skips the step) instead of turning finite.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace mccl {

// The values travel in op signatures (as algorithms): never renumber.
enum class Codec : uint8_t { kOff = 0, kBf16 = 1, kFp16 = 2, kInt8 = 3 };
constexpr int kNumCodecs = 4;

// Elements per int8 scale. Measured on N(0,1) data (docs/compression.md): relative L2 error
// of one quantization 0.47 % at 16, 0.54 % at 32, 0.59 % at 64, 0.70 % at 256, 0.87 % at 4096
// elements, the scales adding 25 %, 12.5 %, 6.25 %, 1.6 %, 0.1 % to the codes' bytes. 64 keeps
// the wire at 1.0625 bytes per element (3.76x fewer than float32, the 3.6x target with room
// for the codec's time) at an error near the smaller blocks'.
constexpr size_t kInt8Block = 64;

const char* codec_name(Codec k);            // "off", "bf16", "fp16", "int8"
bool parse_codec(const std::string& s, Codec* out);
// Whether `k` encodes elements of `dt`: bf16 and fp16 compress float32, int8 compresses
// float32, bfloat16 and float16.
bool codec_applies(Codec k, DType dt);
// Bytes of `n` encoded elements (an encoding of n elements is self-contained).
size_t encoded_bytes(Codec k, size_t n);

// Encodes n elements of `in` (of dtype dt) into `out` (encoded_bytes(k, n) bytes). With a
// `residual` (n floats, error feedback): encodes in + residual and leaves in `residual`
// what the code could not carry, so it is sent with the next op.
void encode(Codec k, DType dt, const void* in, size_t n, uint8_t* out, float* residual);
// Encodes n float32 values (the reduced sum), with a residual as encode's.
void encode_f32(Codec k, const float* in, size_t n, uint8_t* out, float* residual);
// acc[i] += decoded element i, in float32.
void decode_add(Codec k, const uint8_t* in, size_t n, float* acc);
// out[i] = decoded element i, rounded to `dt` (float32, bfloat16 or float16).
void decode(Codec k, const uint8_t* in, size_t n, DType dt, void* out);

// Parts of an encoding, for splitting one chunk's codec work: elements [begin, begin + n) of
// an encoding of `total` elements (`out`/`in` point at the whole encoding, `in`/`acc`/
// `residual`/`out` of plain elements at the part's first element). For int8, begin must be a
// multiple of kInt8Block (n is any, up to total - begin). The bytes a part writes are those
// the whole encode writes there, so parts encoded apart, in any order, make the same encoding.
void encode_part(Codec k, DType dt, const void* in, size_t total, size_t begin, size_t n, uint8_t* out,
                 float* residual);
void decode_part(Codec k, const uint8_t* in, size_t total, size_t begin, size_t n, DType dt, void* out);
void decode_add_part(Codec k, const uint8_t* in, size_t total, size_t begin, size_t n, float* acc);
// out[i] = element i of `in` (dtype dt) in float32.
void load_f32(DType dt, const void* in, size_t n, float* out);

}  // namespace mccl
