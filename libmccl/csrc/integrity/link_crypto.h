// The primitives of the link handshake (transport/handshake.h), all OpenSSL 3's libcrypto:
// HMAC-SHA256 for the proofs of the job secret, HKDF-SHA256 for the per-socket frame keys,
// the system's CSPRNG for nonces and a constant-time compare for checking a proof.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace mccl {

constexpr size_t kLinkNonceBytes = 32;
constexpr size_t kLinkProofBytes = 32;  // HMAC-SHA256

// A view of bytes to feed a MAC or a KDF, in order.
struct Bytes {
  const void* data;
  size_t size;
};

// The job secret a communicator's links prove and derive their keys from. Wiped on
// destruction; never printed.
class LinkSecret {
 public:
  LinkSecret() = default;
  explicit LinkSecret(const std::string& bytes) : bytes_(bytes.begin(), bytes.end()) {}
  LinkSecret(const LinkSecret& o) : bytes_(o.bytes_) {}
  LinkSecret& operator=(const LinkSecret& o);
  ~LinkSecret();
  bool empty() const { return bytes_.empty(); }
  const uint8_t* data() const { return bytes_.data(); }
  size_t size() const { return bytes_.size(); }

 private:
  std::vector<uint8_t> bytes_;
};

// HMAC-SHA256(key, concatenation of parts). Throws Error(kGeneric) if libcrypto fails.
void hmac_sha256(const LinkSecret& key, std::initializer_list<Bytes> parts,
                 uint8_t out[kLinkProofBytes]);

// HKDF-SHA256 (RFC 5869, extract then expand) of `key` into `out_len` bytes.
void hkdf_sha256(const LinkSecret& key, Bytes salt, Bytes info, uint8_t* out, size_t out_len);

// Cryptographically random bytes (RAND_bytes); throws if the CSPRNG cannot deliver.
void random_bytes(uint8_t* out, size_t n);

// Equal in time independent of where the inputs differ (CRYPTO_memcmp).
bool equal_secret(const uint8_t* a, const uint8_t* b, size_t n);

// Overwrites memory that held key material in a way the compiler keeps (OPENSSL_cleanse).
void wipe(void* p, size_t n);

}  // namespace mccl
