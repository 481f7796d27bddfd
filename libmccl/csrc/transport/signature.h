// What the transport knows of the operations it carries: nothing but opaque bytes.
//
// Every collective frame carries the sender's signature of the op it belongs to; the
// receiver compares it with its own op of the same sequence number as soon as the first
// frame arrives, so ranks that disagree fail at once instead of waiting for a frame that
// never matches. What the bytes mean (which collective, dtype, size, root ...) and how a
// disagreement is put into words belong to the layer above, which passes its
// SignatureRules to the transport. The same holds for the handshake's Terms: options both
// ends must share (how messages are cut), compared as bytes, explained from above.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mccl {

constexpr size_t kSignatureBytes = 20;
using Signature = std::array<uint8_t, kSignatureBytes>;

constexpr size_t kTermsBytes = 16;
using Terms = std::array<uint8_t, kTermsBytes>;

class SignatureRules {
 public:
  virtual ~SignatureRules() = default;
  // The op's name in messages ("allreduce"), so they read "[allreduce] ...".
  virtual std::string name(const Signature& s) const = 0;
  // A few words on its arguments for timeout messages ("4096 bytes").
  virtual std::string summary(const Signature& s) const = 0;
  // Empty when a frame signed `theirs` by `who` may belong to our op signed `mine`;
  // otherwise the sentence that says how they differ and what to do. `opno` names the
  // op ("op #12").
  virtual std::string mismatch(const Signature& mine, const Signature& theirs,
                               const std::string& who, const std::string& opno) const = 0;
  // Why the handshake's terms differ (dialer's and acceptor's), for the refusal.
  virtual std::string terms_mismatch(const Terms& dialer, const Terms& acceptor) const = 0;
};

// For a transport used without a layer above (tests, tools): signatures must be equal
// byte for byte and are named only by their sequence number.
class OpaqueSignatureRules : public SignatureRules {
 public:
  std::string name(const Signature&) const override { return "collective"; }
  std::string summary(const Signature&) const override { return "opaque signature"; }
  std::string mismatch(const Signature& mine, const Signature& theirs, const std::string& who,
                       const std::string& opno) const override {
    if (mine == theirs) return {};
    return "signature mismatch with " + who + " for " + opno +
           "; every rank must call the same collectives with the same arguments";
  }
  std::string terms_mismatch(const Terms& dialer, const Terms& acceptor) const override {
    if (dialer == acceptor) return {};
    return "the ranks' algorithm options differ; configure every rank alike";
  }
};

}  // namespace mccl
