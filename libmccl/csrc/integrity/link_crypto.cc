#include "integrity/link_crypto.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include <memory>

#include "core/errors.h"

namespace mccl {

namespace {

[[noreturn]] void crypto_failed(const char* what) {
  throw_error(ErrorKind::kGeneric, std::string("[integrity] OpenSSL failed to ") + what +
                                       "; likely cause: a libcrypto without SHA-256/HMAC/HKDF "
                                       "(FIPS provider misconfigured?); check `openssl list -providers`");
}

struct MacFree {
  void operator()(EVP_MAC* m) const { EVP_MAC_free(m); }
  void operator()(EVP_MAC_CTX* c) const { EVP_MAC_CTX_free(c); }
  void operator()(EVP_KDF* k) const { EVP_KDF_free(k); }
  void operator()(EVP_KDF_CTX* c) const { EVP_KDF_CTX_free(c); }
};

}  // namespace

LinkSecret& LinkSecret::operator=(const LinkSecret& o) {
  if (this != &o) {
    wipe(bytes_.data(), bytes_.size());
    bytes_ = o.bytes_;
  }
  return *this;
}

LinkSecret::~LinkSecret() { wipe(bytes_.data(), bytes_.size()); }

void hmac_sha256(const LinkSecret& key, std::initializer_list<Bytes> parts,
                 uint8_t out[kLinkProofBytes]) {
  std::unique_ptr<EVP_MAC, MacFree> mac(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
  if (!mac) crypto_failed("fetch HMAC");
  std::unique_ptr<EVP_MAC_CTX, MacFree> ctx(EVP_MAC_CTX_new(mac.get()));
  if (!ctx) crypto_failed("create an HMAC context");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  if (EVP_MAC_init(ctx.get(), key.data(), key.size(), params) != 1) crypto_failed("key HMAC");
  for (const Bytes& p : parts) {
    if (EVP_MAC_update(ctx.get(), static_cast<const unsigned char*>(p.data), p.size) != 1) {
      crypto_failed("update HMAC");
    }
  }
  size_t n = 0;
  if (EVP_MAC_final(ctx.get(), out, &n, kLinkProofBytes) != 1 || n != kLinkProofBytes) {
    crypto_failed("finish HMAC");
  }
}

void hkdf_sha256(const LinkSecret& key, Bytes salt, Bytes info, uint8_t* out, size_t out_len) {
  std::unique_ptr<EVP_KDF, MacFree> kdf(EVP_KDF_fetch(nullptr, "HKDF", nullptr));
  if (!kdf) crypto_failed("fetch HKDF");
  std::unique_ptr<EVP_KDF_CTX, MacFree> ctx(EVP_KDF_CTX_new(kdf.get()));
  if (!ctx) crypto_failed("create an HKDF context");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {
      OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_KEY, const_cast<uint8_t*>(key.data()),
                                        key.size()),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_SALT, const_cast<void*>(salt.data),
                                        salt.size),
      OSSL_PARAM_construct_octet_string(OSSL_KDF_PARAM_INFO, const_cast<void*>(info.data),
                                        info.size),
      OSSL_PARAM_construct_end()};
  if (EVP_KDF_derive(ctx.get(), out, out_len, params) != 1) crypto_failed("derive with HKDF");
}

void random_bytes(uint8_t* out, size_t n) {
  if (RAND_bytes(out, static_cast<int>(n)) != 1) crypto_failed("draw random bytes");
}

bool equal_secret(const uint8_t* a, const uint8_t* b, size_t n) {
  return CRYPTO_memcmp(a, b, n) == 0;
}

void wipe(void* p, size_t n) {
  if (p && n) OPENSSL_cleanse(p, n);
}

}  // namespace mccl
