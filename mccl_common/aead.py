"""One direction of an encrypted channel: AES-256-GCM (OpenSSL's EVP, from the libcrypto
Python's hashlib uses: mccl_common/libcrypto.py) under a key used by this direction of this
connection alone.

GCM loses both secrecy and integrity if a (key, nonce) pair ever repeats, so the nonce is
not random but the message's number in its direction: a ``Box`` counts its own messages,
refuses to wrap around, and is made from a key derived from both sides' fresh nonces, so
no other connection or direction ever holds the same key. A receiver opens message n only
as message n: a replayed, dropped, reordered or altered message fails its tag.
"""

from __future__ import annotations

import struct

from . import libcrypto

TAG_BYTES = libcrypto.TAG_BYTES
_NONCE = struct.Struct("!4xQ")       # 96 bits: 32 zero bits, then the 64-bit message number
_MAX_SEQ = (1 << 64) - 1


class Box:
    """Seals (or opens) the messages of one direction in order, numbering them itself."""

    def __init__(self, key: bytes):
        if len(key) != 32:
            raise ValueError("an AES-256-GCM key is 32 bytes")
        self._key = bytes(key)
        libcrypto.lib()         # a missing libcrypto fails here, where the channel is made
        self.seq = 0

    def seal(self, plaintext: bytes, aad: bytes = b"") -> tuple[int, bytes]:
        """(number, ciphertext with its tag) of the next message."""
        seq = self._take()
        return seq, libcrypto.gcm_seal(self._key, _NONCE.pack(seq), bytes(plaintext), bytes(aad))

    def open(self, ciphertext: bytes, aad: bytes = b"") -> bytes | None:
        """The plaintext of the next message, or None when it is not the next message sealed
        under this key with this ``aad``. A failed message does not use up its number."""
        if self.seq > _MAX_SEQ or len(ciphertext) < TAG_BYTES:
            return None
        plain = libcrypto.gcm_open(self._key, _NONCE.pack(self.seq), bytes(ciphertext), bytes(aad))
        if plain is None:
            return None
        self.seq += 1
        return plain

    def _take(self) -> int:
        if self.seq > _MAX_SEQ:
            # Never reached in practice (2^64 messages); reusing a nonce would be far worse.
            raise OverflowError("AEAD message counter exhausted; reconnect")
        seq = self.seq
        self.seq += 1
        return seq
