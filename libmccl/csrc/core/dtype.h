// Element types and reduce ops the engine understands. The numeric values are part
// of the Python binding and the daemon's wire protocol: append, never renumber.
#pragma once
#include <cstddef>
#include <cstdint>

namespace mccl {

enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 8,
};
constexpr int kNumDTypes = 9;

enum class ReduceOp : uint8_t {
  kSum = 0,
  kAvg = 1,
  kMin = 2,
  kMax = 3,
  kProduct = 4,
  kBand = 5,
  kBor = 6,
  kBxor = 7,
};
constexpr int kNumReduceOps = 8;

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt8: return 1;
    case DType::kUInt8: return 1;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DType t);
const char* reduce_op_name(ReduceOp op);
bool dtype_is_valid(int t);
bool reduce_op_is_valid(int op);

}  // namespace mccl
