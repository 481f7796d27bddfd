"""AES-256-GCM from the libcrypto Python's own ``hashlib`` uses (OpenSSL EVP, through ctypes).

One OpenSSL for the whole process: the engine (libmccl/csrc/integrity/) links the system's
libcrypto, and so does Python's ``_hashlib`` on Linux distributions (Debian's libcrypto.so.3).
The ``cryptography`` wheel carried a third, statically linked copy; this module replaces it by
resolving the EVP functions through ``_hashlib``'s own handle, so they come from the very
library ``hashlib``/``hmac`` already loaded, never from another copy. Nothing here is
cryptography of our own: each call is one OpenSSL EVP call, as in the engine's aead.cc.

Found nowhere (a Python whose ``_hashlib`` hides its OpenSSL): the system's libcrypto by name,
and ``library`` says which file that was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

TAG_BYTES = 16
IV_BYTES = 12
KEY_BYTES = 32
# <openssl/evp.h>: the GCM controls (EVP_CTRL_AEAD_* in OpenSSL 3, same values).
_CTRL_GCM_GET_TAG = 0x10
_CTRL_GCM_SET_TAG = 0x11
_MAX_LEN = (1 << 31) - 1 - TAG_BYTES      # EVP lengths are C ints

_lock = threading.Lock()
_lib: "_Lib | None" = None


class _Lib:
    def __init__(self) -> None:
        self.dll, self.library = _load()
        d = self.dll
        vp, cp, ip, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_int
        for name, res, args in (
                ("EVP_CIPHER_CTX_new", vp, []),
                ("EVP_CIPHER_CTX_free", None, [vp]),
                ("EVP_EncryptInit_ex", i, [vp, vp, vp, cp, cp]),
                ("EVP_DecryptInit_ex", i, [vp, vp, vp, cp, cp]),
                ("EVP_EncryptUpdate", i, [vp, vp, ip, cp, i]),
                ("EVP_DecryptUpdate", i, [vp, vp, ip, cp, i]),
                ("EVP_EncryptFinal_ex", i, [vp, vp, ip]),
                ("EVP_DecryptFinal_ex", i, [vp, vp, ip]),
                ("EVP_CIPHER_CTX_ctrl", i, [vp, i, i, vp]),
                ("EVP_aes_256_gcm", vp, [])):
            fn = getattr(d, name)
            fn.restype, fn.argtypes = res, args
        # OpenSSL 3: fetch the implementation once, not implicitly at every init.
        fetch = getattr(d, "EVP_CIPHER_fetch", None)
        cipher = None
        if fetch is not None:
            fetch.restype, fetch.argtypes = vp, [vp, cp, cp]
            cipher = fetch(None, b"AES-256-GCM", None)
        self.cipher = cipher or d.EVP_aes_256_gcm()
        if not self.cipher:
            raise OSError(f"{self.library} has no AES-256-GCM")


def _load() -> tuple[ctypes.CDLL, str]:
    """libcrypto as Python's _hashlib sees it (dlsym through its handle searches the libraries
    it links), else the system's by name."""
    try:
        import _hashlib
        dll = ctypes.CDLL(_hashlib.__file__)
        dll.EVP_CIPHER_CTX_new  # noqa: B018 - raises AttributeError if not reachable from here
        return dll, f"the libcrypto of {_hashlib.__file__}"
    except (ImportError, OSError, AttributeError):
        pass
    name = ctypes.util.find_library("crypto")
    if not name:
        raise OSError("no OpenSSL libcrypto found (Python's _hashlib exposes none and the system has none); "
                      "install OpenSSL 3")
    return ctypes.CDLL(name), name


def lib() -> _Lib:
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _Lib()
    return _lib


def _check(ok: int, what: str) -> None:
    if ok != 1:
        raise OSError(f"OpenSSL {what} failed")


def gcm_seal(key: bytes, iv: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """ciphertext || 16-byte tag of ``plaintext`` under AES-256-GCM(key, iv), ``aad`` bound."""
    _sizes(key, iv, plaintext, aad)
    L = lib()
    d = L.dll
    ctx = d.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("EVP_CIPHER_CTX_new")
    try:
        n = ctypes.c_int(0)
        out = ctypes.create_string_buffer(len(plaintext) + TAG_BYTES)
        # GCM's default IV length is the 12 bytes used here: cipher, key and IV in one call.
        _check(d.EVP_EncryptInit_ex(ctx, L.cipher, None, key, iv), "EncryptInit")
        if aad:
            _check(d.EVP_EncryptUpdate(ctx, None, ctypes.byref(n), aad, len(aad)), "EncryptUpdate (aad)")
        done = 0
        if plaintext:
            _check(d.EVP_EncryptUpdate(ctx, out, ctypes.byref(n), plaintext, len(plaintext)), "EncryptUpdate")
            done = n.value
        _check(d.EVP_EncryptFinal_ex(ctx, ctypes.byref(out, done), ctypes.byref(n)), "EncryptFinal")
        done += n.value
        _check(d.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_GET_TAG, TAG_BYTES, ctypes.byref(out, done)), "get tag")
        return out.raw[:done + TAG_BYTES]
    finally:
        d.EVP_CIPHER_CTX_free(ctx)


def gcm_open(key: bytes, iv: bytes, sealed: bytes, aad: bytes) -> bytes | None:
    """The plaintext of ``sealed`` (ciphertext || tag), or None when its tag does not match.
    Nothing decrypted leaves this function before the tag matched."""
    if len(sealed) < TAG_BYTES:
        return None
    _sizes(key, iv, sealed, aad)
    L = lib()
    d = L.dll
    body, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
    ctx = d.EVP_CIPHER_CTX_new()
    if not ctx:
        raise MemoryError("EVP_CIPHER_CTX_new")
    try:
        n = ctypes.c_int(0)
        out = ctypes.create_string_buffer(len(body) + TAG_BYTES)
        # GCM's default IV length is the 12 bytes used here: cipher, key and IV in one call.
        _check(d.EVP_DecryptInit_ex(ctx, L.cipher, None, key, iv), "DecryptInit")
        if aad:
            _check(d.EVP_DecryptUpdate(ctx, None, ctypes.byref(n), aad, len(aad)), "DecryptUpdate (aad)")
        done = 0
        if body:
            _check(d.EVP_DecryptUpdate(ctx, out, ctypes.byref(n), body, len(body)), "DecryptUpdate")
            done = n.value
        tag_buf = ctypes.create_string_buffer(tag, TAG_BYTES)
        _check(d.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GCM_SET_TAG, TAG_BYTES, tag_buf), "set tag")
        if d.EVP_DecryptFinal_ex(ctx, ctypes.byref(out, done), ctypes.byref(n)) != 1:
            ctypes.memset(out, 0, len(body))   # what failed its tag is not kept around either
            return None
        return out.raw[:done + n.value]
    finally:
        d.EVP_CIPHER_CTX_free(ctx)


def _sizes(key: bytes, iv: bytes, data: bytes, aad: bytes) -> None:
    if len(key) != KEY_BYTES:
        raise ValueError("an AES-256-GCM key is 32 bytes")
    if len(iv) != IV_BYTES:
        raise ValueError("a GCM nonce here is 12 bytes")
    if len(data) > _MAX_LEN or len(aad) > _MAX_LEN:
        raise ValueError("message too large for one AES-GCM call")


__all__ = ["IV_BYTES", "KEY_BYTES", "TAG_BYTES", "gcm_open", "gcm_seal", "lib"]
