#include "communicator/op_signature.h"

#include "core/le.h"

namespace mccl {

namespace {

static_assert(1 + 1 + 8 + 1 + 1 + 4 + 4 == kSignatureBytes, "OpSignature fills the signature");
static_assert(8 + 8 == kTermsBytes, "terms_of fills the terms");

bool known(OpKind k) {
  return (k >= OpKind::kAllreduce && k <= OpKind::kBarrier) || k == OpKind::kCalibrate;
}

std::string kind_text(OpKind k) {
  return known(k) ? op_kind_name(k) : "unknown op " + std::to_string(static_cast<unsigned>(k));
}

std::string dtype_text(uint8_t d) {
  return d < kNumDTypes ? dtype_name(static_cast<DType>(d)) : "dtype " + std::to_string(d);
}

std::string redop_text(uint8_t r) {
  return r < kNumReduceOps ? reduce_op_name(static_cast<ReduceOp>(r)) : "op " + std::to_string(r);
}

std::string algo_text(uint8_t a) {
  return a <= kMaxAlgo ? algo_name(static_cast<Algo>(a)) : "algorithm " + std::to_string(a);
}

std::string pieces_text(uint32_t p) {
  return p ? "pipelined by tickets in " + std::to_string(p) + " pieces" : std::string("not pipelined");
}

}  // namespace

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kReduce: return "reduce";
    case OpKind::kGather: return "gather";
    case OpKind::kScatter: return "scatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kAlltoallv: return "alltoallv";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kP2P: return "send/recv";
    case OpKind::kCalibrate: return "calibrate";
  }
  return "unknown";
}

Signature encode_signature(const OpSignature& s) {
  Signature out{};
  uint8_t* p = out.data();
  put_le<uint8_t>(p, static_cast<uint8_t>(s.kind));
  put_le<uint8_t>(p, s.algo);
  put_le<uint64_t>(p, s.op_bytes);
  put_le<uint8_t>(p, s.dtype);
  put_le<uint8_t>(p, s.redop);
  put_le<uint32_t>(p, static_cast<uint32_t>(s.root));
  put_le<uint32_t>(p, s.pieces);
  return out;
}

OpSignature decode_signature(const Signature& in) {
  const uint8_t* p = in.data();
  OpSignature s;
  s.kind = static_cast<OpKind>(get_le<uint8_t>(p));
  s.algo = get_le<uint8_t>(p);
  s.op_bytes = get_le<uint64_t>(p);
  s.dtype = get_le<uint8_t>(p);
  s.redop = get_le<uint8_t>(p);
  s.root = static_cast<int32_t>(get_le<uint32_t>(p));
  s.pieces = get_le<uint32_t>(p);
  return s;
}

Terms terms_of(const Options& opts) {
  Terms out{};
  uint8_t* p = out.data();
  put_le<uint64_t>(p, opts.segment_bytes);
  put_le<uint64_t>(p, opts.small_allreduce_bytes);
  return out;
}

std::string CollectiveRules::name(const Signature& s) const {
  return kind_text(decode_signature(s).kind);
}

std::string CollectiveRules::summary(const Signature& s) const {
  return std::to_string(decode_signature(s).op_bytes) + " bytes";
}

std::string CollectiveRules::mismatch(const Signature& mine_sig, const Signature& theirs_sig,
                                      const std::string& who, const std::string& opno) const {
  const OpSignature mine = decode_signature(mine_sig);
  const OpSignature theirs = decode_signature(theirs_sig);
  if (theirs.kind != mine.kind) {
    return "collective mismatch with " + who + ": it runs " + kind_text(theirs.kind) + " as " +
           opno + ", this rank runs " + kind_text(mine.kind) +
           "; every rank must call the same collectives in the same order";
  }
  if (theirs.op_bytes != mine.op_bytes) {
    return "size mismatch with " + who + ": it sent " + std::to_string(theirs.op_bytes) +
           " bytes for " + opno + ", this rank expects " + std::to_string(mine.op_bytes) +
           "; every rank must pass tensors of the same size";
  }
  if (theirs.dtype != mine.dtype) {
    return "dtype mismatch with " + who + " for " + opno + ": it uses " +
           dtype_text(theirs.dtype) + ", this rank " + dtype_text(mine.dtype) +
           "; every rank must pass the same dtype";
  }
  if (theirs.redop != mine.redop) {
    return "reduce-op mismatch with " + who + " for " + opno + ": it uses " +
           redop_text(theirs.redop) + ", this rank " + redop_text(mine.redop) +
           "; every rank must pass the same op";
  }
  if (theirs.pieces != mine.pieces) {
    return "pipelining mismatch with " + who + " for " + opno + ": it runs it " +
           pieces_text(theirs.pieces) + ", this rank " + pieces_text(mine.pieces) +
           "; every rank must pass tickets alike and use the same MCCL_PIPELINE_BYTES";
  }
  if (theirs.algo != mine.algo) {
    return "algorithm mismatch with " + who + " for " + opno + ": it runs " +
           kind_text(mine.kind) + " by " + algo_text(theirs.algo) + ", this rank by " +
           algo_text(mine.algo) + "; set MCCL_ALGO, MCCL_ALPHA_US and MCCL_BETA_GBPS the same "
           "on every rank";
  }
  if (theirs.root != mine.root && mine.kind == OpKind::kAllreduce) {
    auto how = [](int32_t f) { return f < 0 ? std::string("flat") : "by switch (grouping " + std::to_string(f) + ")"; };
    return "topology mismatch with " + who + " for " + opno + ": it runs it " + how(theirs.root) +
           ", this rank " + how(mine.root) +
           "; give every rank the same MCCL_TOPOLOGY, MCCL_HIERARCHY and MCCL_HIERARCHY_MIN_BYTES";
  }
  if (theirs.root != mine.root) {
    return "root mismatch with " + who + " for " + opno + ": it uses root " +
           std::to_string(theirs.root) + ", this rank " + std::to_string(mine.root) +
           "; every rank must pass the same root";
  }
  if (theirs_sig != mine_sig) {
    return "signature mismatch with " + who + " for " + opno +
           " in bytes this build does not use; run the same MCCL build on every rank";
  }
  return {};
}

std::string CollectiveRules::terms_mismatch(const Terms& dialer, const Terms& acceptor) const {
  const uint8_t* d = dialer.data();
  const uint8_t* a = acceptor.data();
  const uint64_t d_seg = get_le<uint64_t>(d), d_small = get_le<uint64_t>(d);
  const uint64_t a_seg = get_le<uint64_t>(a), a_small = get_le<uint64_t>(a);
  auto n = [](uint64_t v) { return std::to_string(v); };
  if (d_seg != a_seg) {
    return "pipeline segment mismatch (dialer " + n(d_seg) + ", acceptor " + n(a_seg) +
           " bytes); set MCCL_SEGMENT_BYTES the same on every rank";
  }
  if (d_small != a_small) {
    return "small all-reduce threshold mismatch (dialer " + n(d_small) + ", acceptor " +
           n(a_small) + " bytes); set MCCL_SMALL_ALLREDUCE_BYTES the same on every rank";
  }
  return {};
}

}  // namespace mccl
