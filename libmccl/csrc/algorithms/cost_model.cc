#include "algorithms/cost_model.h"

#include <algorithm>
#include <cmath>

#include "algorithms/partners.h"
#include "core/errors.h"

namespace mccl {

namespace {

struct Shape {
  double n, p, steps, fold;  // ranks, core ranks, log2 P, 1 if folded
};

Shape shape(int n) {
  Shape s;
  s.n = n;
  s.p = pow2_floor(std::max(n, 1));
  s.steps = std::log2(s.p);
  s.fold = n > s.p ? 1 : 0;
  return s;
}

// One term per algorithm: steps, bytes on the critical path, bytes reduced on it. The
// ring reduces a segment while the next one is on the wire, so its reductions are off the
// critical path (0); the hypercube steps exchange whole halves in lock-step, and the last
// bytes of a step are reduced before the next step can start. That is what makes the ring
// the large-message choice even where its 2(N-1) steps and Rabenseifner's bytes agree.
struct Cost {
  double steps, bytes, reduced;
  double encoded = 0, decoded = 0;  // float32 bytes through a codec's encoder and decoder
};

// The lock-step algorithms (hypercube exchanges, trees) move their bytes more slowly than
// the pipelined ring, which keeps every link busy all the time: on the 16-core machine at 64
// emulated hosts (6 Dec, docs/results/device-issue26-scale) Rabenseifner's all-reduce took
// 1.1x, 1.55x and 2.0x the ring's time at 256 KB, 1 MB and 4 MB where the two move the same
// bytes (at 8 hosts, 1.0x). Their bytes count this much more, so they win where the ring's
// 2(N-1) latencies dominate, not where the model could only call a tie.
constexpr double kLockstepByteCost = 1.6;

Cost lockstep(Cost c) {
  c.bytes *= kLockstepByteCost;
  return c;
}

// The pipelined chain broadcast: S segments through N-1 hops take S + N - 2 segment times
// (broadcast.cc picks the segment).
Cost chain_cost(int n, double bytes) {
  if (n <= 2) return {1, bytes, 0};
  const double seg = std::clamp(bytes / (32.0 * (n - 2)), double(128 << 10), double(4 << 20));
  const double segs = std::max(1.0, std::ceil(bytes / seg));
  const double per = bytes / segs;
  return {segs + n - 2, (segs + n - 2) * per, 0};
}

// Encoded bytes per float32 byte.
double wire_ratio(Algo a) {
  const Codec k = codec_of(a);
  return k == Codec::kOff ? 1.0 : double(encoded_bytes(k, 1 << 20)) / double(4 << 20);
}

Cost cost(AlgoOp op, Algo a, int n, double b) {
  const Shape s = shape(n);
  const double N = s.n, P = s.p, L = s.steps, F = s.fold;
  switch (op) {
    case AlgoOp::kAllreduce:
      switch (a) {
        case Algo::kRing: return {2 * (N - 1), 2 * (N - 1) / N * b, 0};
        case Algo::kOneRound: return {1, (N - 1) * b, (N - 1) * b};
        case Algo::kRecursiveDoubling: return lockstep({L + 2 * F, (L + 2 * F) * b, (L + F) * b});
        case Algo::kRabenseifner:
          return lockstep({2 * L + 2 * F, 2 * (P - 1) / P * b + 2 * F * b, (P - 1) / P * b + F * b});
        case Algo::kCompressedBf16:
        case Algo::kCompressedFp16:
        case Algo::kCompressedInt8:
          // compressed.cc: (N-1)/N of the buffer encoded and sent, as much decoded and added
          // by the owners, each owner's sum encoded (b/N) and every result decoded (b).
          return {2 * (N - 1), 2 * (N - 1) / N * b * wire_ratio(a), (N - 1) / N * b, b, b * (2 * N - 1) / N};
        default: break;
      }
      break;
    case AlgoOp::kAllgather:  // b: one rank's block; N b gathered
      switch (a) {
        case Algo::kRing: return {N - 1, (N - 1) * b, 0};
        case Algo::kRecursiveDoubling:
          return lockstep({L + 2 * F, F * b + (P - 1) / P * N * b + F * N * b, 0});
        default: break;
      }
      break;
    case AlgoOp::kReduceScatter:  // b: one rank's block; N b reduced
      switch (a) {
        case Algo::kRing: return {N - 1, (N - 1) * b, 0};
        case Algo::kRecursiveHalving:
          return lockstep({L + 2 * F, F * N * b + (P - 1) / P * N * b + F * b, (P - 1) / P * N * b + F * N * b});
        case Algo::kCompressedBf16:
        case Algo::kCompressedFp16:
        case Algo::kCompressedInt8:
          return {N - 1, (N - 1) * b * wire_ratio(a), (N - 1) * b, (N - 1) * b, (N - 1) * b};
        default: break;
      }
      break;
    case AlgoOp::kBroadcast:
      switch (a) {
        case Algo::kFanout: return {1, (N - 1) * b, 0};
        case Algo::kChain: return chain_cost(n, b);
        case Algo::kBinomial: return lockstep({L + 2 * F, (L + 2 * F) * b, 0});
        case Algo::kScatterAllgather: return lockstep({2 * L + 2 * F, 2 * (P - 1) / P * b + 2 * F * b, 0});
        default: break;
      }
      break;
  }
  return {INFINITY, INFINITY, INFINITY};
}

[[noreturn]] void bad_spec(const std::string& spec, const std::string& why) {
  throw_error(ErrorKind::kConfig, "[engine] MCCL_ALGO=" + spec + ": " + why +
                                      "; use auto, one algorithm (ring, direct, oneround, rd, "
                                      "rabenseifner, halving, chain, fanout, binomial, "
                                      "scatter_allgather) or op=algorithm pairs separated by "
                                      "commas (ops: allreduce, allgather, reduce_scatter, broadcast)");
}

}  // namespace

const char* algo_name(Algo a) {
  switch (a) {
    case Algo::kAuto: return "auto";
    case Algo::kRing: return "ring";
    case Algo::kOneRound: return "oneround";
    case Algo::kRecursiveDoubling: return "rd";
    case Algo::kRabenseifner: return "rabenseifner";
    case Algo::kRecursiveHalving: return "halving";
    case Algo::kChain: return "chain";
    case Algo::kFanout: return "fanout";
    case Algo::kBinomial: return "binomial";
    case Algo::kScatterAllgather: return "scatter_allgather";
    case Algo::kCompressedBf16: return "compressed-bf16";
    case Algo::kCompressedFp16: return "compressed-fp16";
    case Algo::kCompressedInt8: return "compressed-int8";
  }
  return "unknown";
}

Codec codec_of(Algo a) {
  switch (a) {
    case Algo::kCompressedBf16: return Codec::kBf16;
    case Algo::kCompressedFp16: return Codec::kFp16;
    case Algo::kCompressedInt8: return Codec::kInt8;
    default: return Codec::kOff;
  }
}

Algo compressed_algo(Codec k) {
  switch (k) {
    case Codec::kBf16: return Algo::kCompressedBf16;
    case Codec::kFp16: return Algo::kCompressedFp16;
    case Codec::kInt8: return Algo::kCompressedInt8;
    default: return Algo::kAuto;
  }
}

// CPU seconds per float32 byte of one core (tools/bench codec microbenchmark, `python -m
// tools.bench codecs`; docs/compression.md): the worker encodes and decodes on its own thread.
double codec_encode_s_per_byte(Codec k) {
  switch (k) {
    case Codec::kBf16: return kCodecEncodeSPerGB[1] * 1e-9;
    case Codec::kFp16: return kCodecEncodeSPerGB[2] * 1e-9;
    case Codec::kInt8: return kCodecEncodeSPerGB[3] * 1e-9;
    default: return 0;
  }
}

double codec_decode_s_per_byte(Codec k) {
  switch (k) {
    case Codec::kBf16: return kCodecDecodeSPerGB[1] * 1e-9;
    case Codec::kFp16: return kCodecDecodeSPerGB[2] * 1e-9;
    case Codec::kInt8: return kCodecDecodeSPerGB[3] * 1e-9;
    default: return 0;
  }
}

const char* algo_op_name(AlgoOp o) {
  switch (o) {
    case AlgoOp::kAllreduce: return "allreduce";
    case AlgoOp::kAllgather: return "allgather";
    case AlgoOp::kReduceScatter: return "reduce_scatter";
    case AlgoOp::kBroadcast: return "broadcast";
  }
  return "unknown";
}

bool parse_algo_op(const std::string& s, AlgoOp* out) {
  for (int i = 0; i < kNumAlgoOps; ++i) {
    if (s == algo_op_name(static_cast<AlgoOp>(i))) {
      *out = static_cast<AlgoOp>(i);
      return true;
    }
  }
  return false;
}

bool parse_algo(const std::string& s, Algo* out) {
  for (int i = 0; i <= kMaxAlgo; ++i) {
    if (s == algo_name(static_cast<Algo>(i))) {
      *out = static_cast<Algo>(i);
      return true;
    }
  }
  return false;
}

bool parse_algo_for(AlgoOp op, const std::string& s, Algo* out) {
  Algo a;
  if (s == "direct") {
    a = op == AlgoOp::kBroadcast ? Algo::kFanout : Algo::kOneRound;
  } else if (s == "ring" && op == AlgoOp::kBroadcast) {
    a = Algo::kChain;
  } else if (!parse_algo(s, &a)) {
    return false;
  }
  if (a != Algo::kAuto && !algo_applies(op, a)) return false;
  *out = a;
  return true;
}

const std::vector<Algo>& algos_of(AlgoOp op) {
  static const std::vector<Algo> ar{Algo::kOneRound, Algo::kRecursiveDoubling, Algo::kRabenseifner,
                                    Algo::kRing};
  static const std::vector<Algo> ag{Algo::kRecursiveDoubling, Algo::kRing};
  static const std::vector<Algo> rs{Algo::kRecursiveHalving, Algo::kRing};
  static const std::vector<Algo> bc{Algo::kFanout, Algo::kBinomial, Algo::kScatterAllgather,
                                    Algo::kChain};
  switch (op) {
    case AlgoOp::kAllreduce: return ar;
    case AlgoOp::kAllgather: return ag;
    case AlgoOp::kReduceScatter: return rs;
    case AlgoOp::kBroadcast: return bc;
  }
  return ar;
}

bool algo_applies(AlgoOp op, Algo a) {
  const auto& v = algos_of(op);
  return std::find(v.begin(), v.end(), a) != v.end();
}

AlgoPins AlgoPins::parse(const std::string& spec) {
  AlgoPins pins;
  if (spec.empty() || spec == "auto") return pins;
  if (spec.find('=') == std::string::npos) {
    bool any = false;
    for (int i = 0; i < kNumAlgoOps; ++i) any = parse_algo_for(static_cast<AlgoOp>(i), spec, &pins.pin[i]) || any;
    if (!any) bad_spec(spec, "unknown algorithm '" + spec + "'");
    return pins;
  }
  size_t at = 0;
  while (at <= spec.size()) {
    size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(at, end - at);
    const size_t eq = item.find('=');
    if (eq == std::string::npos) bad_spec(spec, "'" + item + "' is not op=algorithm");
    AlgoOp op;
    Algo a;
    if (!parse_algo_op(item.substr(0, eq), &op)) {
      bad_spec(spec, "unknown op '" + item.substr(0, eq) + "'");
    }
    if (!parse_algo_for(op, item.substr(eq + 1), &a)) {
      bad_spec(spec, std::string(algo_op_name(op)) + " has no algorithm '" + item.substr(eq + 1) + "'");
    }
    pins.pin[static_cast<int>(op)] = a;
    at = end + 1;
  }
  return pins;
}

double predict(AlgoOp op, Algo a, int n, size_t bytes, const CostParams& p) {
  if (n <= 1) return 0;
  const Cost k = cost(op, a, n, double(bytes));
  const Codec codec = codec_of(a);
  return k.steps * p.alpha_s + k.bytes * p.beta_s_per_byte + k.reduced * p.gamma_s_per_byte +
         k.encoded * codec_encode_s_per_byte(codec) + k.decoded * codec_decode_s_per_byte(codec);
}

bool auto_eligible(AlgoOp op, Algo a, int n, size_t bytes, const Options& opts) {
  if (a == Algo::kOneRound || a == Algo::kFanout) {
    return n <= 4 && double(bytes) * (n - 1) <= double(opts.small_allreduce_bytes);
  }
  (void)op;
  return true;
}

Algo choose(AlgoOp op, int n, size_t bytes, const CostParams& p, const Options& opts) {
  Algo best = Algo::kAuto;
  double best_t = INFINITY;
  for (Algo a : algos_of(op)) {
    if (!auto_eligible(op, a, n, bytes, opts)) continue;
    const double t = predict(op, a, n, bytes, p);
    if (best == Algo::kAuto || t < best_t) {
      best = a;
      best_t = t;
    }
  }
  return best;
}

Algo select_algo(AlgoOp op, const AlgoPins& pins, int n, size_t bytes, const CostParams& p,
                 const Options& opts) {
  const Algo pin = pins.of(op);
  if (pin != Algo::kAuto) return pin;
  return choose(op, n, bytes, p, opts);
}

}  // namespace mccl
