// Which algorithm runs a collective: the cheapest by an alpha-beta(-gamma) model,
//   time = steps x alpha + bytes on the critical path x beta + bytes reduced x gamma,
// alpha the latency of one step between two ranks (seconds), beta the time per byte on
// a link (seconds/byte), gamma the time per byte of a local reduction.
//
// The choice is a pure function of (op, world size, bytes, alpha, beta, gamma, options),
// so ranks holding the same parameters choose alike. The communicator measures the
// parameters once and agrees on them (every rank takes the maximum), and signs every op
// with the algorithm it chose, so ranks that still disagree (a different MCCL_ALGO, say)
// fail with CollectiveMismatch instead of exchanging frames that never match.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "compress/codec.h"
#include "core/options.h"

namespace mccl {

// The collectives that have a choice.
enum class AlgoOp : uint8_t { kAllreduce = 0, kAllgather = 1, kReduceScatter = 2, kBroadcast = 3 };
constexpr int kNumAlgoOps = 4;

// Their algorithms. The values travel in op signatures: never renumber.
enum class Algo : uint8_t {
  kAuto = 0,
  kRing = 1,               // all-reduce, all-gather, reduce-scatter: the pipelined ring
  kOneRound = 2,           // all-reduce: every rank sends its buffer to every other
  kRecursiveDoubling = 3,  // all-reduce, all-gather
  kRabenseifner = 4,       // all-reduce: recursive halving + recursive doubling
  kRecursiveHalving = 5,   // reduce-scatter
  kChain = 6,              // broadcast: the pipelined chain
  kFanout = 7,             // broadcast: straight from the root to every rank
  kBinomial = 8,           // broadcast: binomial tree
  kScatterAllgather = 9,   // broadcast: binomial scatter + recursive-doubling all-gather
  // All-reduce, reduce-scatter under MCCL_COMPRESSION (compressed.cc): never chosen by the
  // model or pinned by MCCL_ALGO (compression is asked for, since it changes the results).
  kCompressedBf16 = 10,
  kCompressedFp16 = 11,
  kCompressedInt8 = 12,
};
constexpr int kMaxAlgo = 12;

// The codec a compressed algorithm runs (kOff for every other), and back (kAuto for kOff).
Codec codec_of(Algo a);
Algo compressed_algo(Codec k);
// A codec's CPU seconds per GB of float32 (1e9 bytes) on one core, encoding and decoding
// with error feedback, measured with `python -m tools.bench codecs` (index: Codec), medians
// of three runs. (2-core x86 VM, AMD EPYC running the AVX2 clones, 7 Dec 15:25: bf16 0.16 /
// 0.05, fp16 0.16 / 0.05, int8 0.14 / 0.05 s/GB; before the codec's loops were restructured
// and cloned for AVX2 (1e8549b): 0.19 / 0.05, 0.60 / 0.13, 0.34 / 0.05.)
constexpr double kCodecEncodeSPerGB[kNumCodecs] = {0, 0.16, 0.16, 0.14};
constexpr double kCodecDecodeSPerGB[kNumCodecs] = {0, 0.05, 0.05, 0.05};
double codec_encode_s_per_byte(Codec k);
double codec_decode_s_per_byte(Codec k);

const char* algo_name(Algo a);      // "ring", "rd", ... as MCCL_ALGO spells them
const char* algo_op_name(AlgoOp o); // "allreduce", ...
bool parse_algo_op(const std::string& s, AlgoOp* out);
bool parse_algo(const std::string& s, Algo* out);  // accepts "auto" too
// The name as `op` reads it: parse_algo, plus "direct" for the one-step algorithm
// (oneround, fanout) and "ring" for broadcast's chain, so a name that means one shape on
// every op pins it on every op. False where `op` has no such algorithm.
bool parse_algo_for(AlgoOp op, const std::string& s, Algo* out);
// The algorithms of one op, in the order ties are broken.
const std::vector<Algo>& algos_of(AlgoOp op);
bool algo_applies(AlgoOp op, Algo a);

struct CostParams {
  double alpha_s = 0;           // seconds per step
  double beta_s_per_byte = 0;   // seconds per byte on a link
  double gamma_s_per_byte = 0;  // seconds per byte reduced (0: not modelled)
};

// MCCL_ALGO, parsed: one pin per op, kAuto where unpinned. Syntax: "auto"; one name,
// pinning every op it applies to ("ring", "rd", "direct"; parse_algo_for); or op=name pairs separated by commas
// ("allreduce=rabenseifner,allgather=ring"). Throws ConfigError naming what is wrong.
struct AlgoPins {
  Algo pin[kNumAlgoOps] = {Algo::kAuto, Algo::kAuto, Algo::kAuto, Algo::kAuto};
  static AlgoPins parse(const std::string& spec);
  Algo of(AlgoOp op) const { return pin[static_cast<int>(op)]; }
};

// The model's time in seconds. `bytes`: the buffer of an all-reduce or broadcast, one
// rank's block of an all-gather (its input) or of a reduce-scatter (its output).
double predict(AlgoOp op, Algo a, int n, size_t bytes, const CostParams& p);

// Whether the automatic choice may take `a`: one-round and fan-out talk to every rank,
// so only where every rank is a collective peer (N <= 4, partners.h) and within
// MCCL_SMALL_ALLREDUCE_BYTES of link bytes.
bool auto_eligible(AlgoOp op, Algo a, int n, size_t bytes, const Options& opts);

// The cheapest eligible algorithm by the model (the first in algos_of order on a tie).
Algo choose(AlgoOp op, int n, size_t bytes, const CostParams& p, const Options& opts);

// What runs: the pin if there is one, else choose(). Never kAuto for n > 1.
Algo select_algo(AlgoOp op, const AlgoPins& pins, int n, size_t bytes, const CostParams& p,
                 const Options& opts);

}  // namespace mccl
