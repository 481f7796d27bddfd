#include "integrity/aead.h"

#include <openssl/err.h>
#include <openssl/evp.h>

#include <string>

#include "core/errors.h"
#include "core/le.h"

namespace mccl {

namespace {

constexpr size_t kNonceBytes = 12;

[[noreturn]] void openssl_failed(const char* what) {
  char buf[256];
  ERR_error_string_n(ERR_get_error(), buf, sizeof(buf));
  throw_error(ErrorKind::kGeneric, std::string("[engine] OpenSSL ") + what + " failed (" + buf +
                                       "); likely cause: a broken or FIPS-restricted libcrypto; "
                                       "check the OpenSSL 3 installation MCCL was built with");
}

// OpenSSL's lengths are int; records are at most kRecordBytes and headers far smaller.
int as_int(size_t n) { return static_cast<int>(n); }

}  // namespace

RecordCipher::RecordCipher(WireSecurity mode, const uint8_t key[kMacKeyBytes], bool seals)
    : mode_(mode) {
  static_assert(kMacKeyBytes == 32, "AES-256 takes a 32-byte key");
  ctx_ = EVP_CIPHER_CTX_new();
  if (!ctx_) openssl_failed("EVP_CIPHER_CTX_new");
  // The key schedule is set up once; each record then only sets its nonce.
  EVP_CIPHER* gcm = EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr);
  const bool ok = gcm && EVP_CipherInit_ex(ctx_, gcm, nullptr, key, nullptr, seals ? 1 : 0) == 1;
  EVP_CIPHER_free(gcm);
  if (!ok) {
    EVP_CIPHER_CTX_free(ctx_);
    ctx_ = nullptr;
    openssl_failed("AES-256-GCM setup");
  }
}

RecordCipher::~RecordCipher() { EVP_CIPHER_CTX_free(ctx_); }

void RecordCipher::start(RecordStream stream) {
  const int s = static_cast<int>(stream);
  if (next_[s] >= kMaxRecords) {
    throw_error(ErrorKind::kProtocol,
                "[engine] a link socket has carried " + std::to_string(kMaxRecords) +
                    " records under one key, the most it may; the link is dropped rather than "
                    "reuse a nonce; build a new communicator (its handshake derives new keys)");
  }
  uint8_t nonce[kNonceBytes];
  uint8_t* p = nonce;
  put_le<uint32_t>(p, static_cast<uint32_t>(stream));
  put_le<uint64_t>(p, next_[s]++);
  if (EVP_CipherInit_ex(ctx_, nullptr, nullptr, nullptr, nonce, -1) != 1) openssl_failed("nonce setup");
}

void RecordCipher::seal(RecordStream stream, const uint8_t* aad, size_t aad_n, const uint8_t* in,
                        uint8_t* out, size_t n, uint8_t tag[kTagBytes]) {
  start(stream);
  int len = 0;
  bool ok = EVP_EncryptUpdate(ctx_, nullptr, &len, aad, as_int(aad_n)) == 1;
  if (ok && n) {
    ok = encrypts() ? EVP_EncryptUpdate(ctx_, out, &len, in, as_int(n)) == 1
                    : EVP_EncryptUpdate(ctx_, nullptr, &len, in, as_int(n)) == 1;
  }
  uint8_t tail[16];
  ok = ok && EVP_EncryptFinal_ex(ctx_, tail, &len) == 1 &&
       EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_GET_TAG, kTagBytes, tag) == 1;
  if (!ok) openssl_failed("AES-256-GCM seal");
}

bool RecordCipher::open(RecordStream stream, const uint8_t* aad, size_t aad_n, uint8_t* data, size_t n,
                        const uint8_t tag[kTagBytes]) {
  start(stream);
  int len = 0;
  if (EVP_DecryptUpdate(ctx_, nullptr, &len, aad, as_int(aad_n)) != 1) openssl_failed("AES-256-GCM open");
  if (n) {
    const bool ok = encrypts() ? EVP_DecryptUpdate(ctx_, data, &len, data, as_int(n)) == 1
                               : EVP_DecryptUpdate(ctx_, nullptr, &len, data, as_int(n)) == 1;
    if (!ok) openssl_failed("AES-256-GCM open");
  }
  if (EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_AEAD_SET_TAG, kTagBytes, const_cast<uint8_t*>(tag)) != 1) {
    openssl_failed("AES-256-GCM tag");
  }
  uint8_t tail[16];
  // Final compares the tags in constant time; a mismatch is the peer's fault, not ours.
  const bool authentic = EVP_DecryptFinal_ex(ctx_, tail, &len) == 1;
  if (!authentic) ERR_clear_error();
  return authentic;
}

}  // namespace mccl
