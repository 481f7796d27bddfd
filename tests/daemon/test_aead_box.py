"""mccl_common.aead.Box, the AES-256-GCM direction under the launch endpoint and the daemon
links: a message opens only as the next one of its direction, under its own key and labels."""

from __future__ import annotations

import pytest

from mccl_common import aead

KEY = bytes(range(32))


def test_messages_open_in_order_and_a_replay_or_a_skip_does_not():
    tx, rx = aead.Box(KEY), aead.Box(KEY)
    first = tx.seal(b"one", b"label")
    second = tx.seal(b"two", b"label")
    assert [first[0], second[0]] == [0, 1]
    assert rx.open(second[1], b"label") is None          # skipped ahead: not message 0
    assert rx.open(first[1], b"label") == b"one"
    assert rx.open(first[1], b"label") is None           # replayed: its number is used up
    assert rx.open(second[1], b"label") == b"two"


def test_the_same_plaintext_never_gives_the_same_ciphertext_and_labels_are_bound():
    tx = aead.Box(KEY)
    a, b = tx.seal(b"beat", b"x")[1], tx.seal(b"beat", b"x")[1]
    assert a != b and b"beat" not in a                    # a fresh nonce per message
    assert aead.Box(KEY).open(a, b"y") is None            # other associated data: refused
    assert aead.Box(bytes(32)).open(a, b"x") is None      # other key: refused
    flipped = bytes([a[0] ^ 1]) + a[1:]
    assert aead.Box(KEY).open(flipped, b"x") is None
    assert aead.Box(KEY).open(a[:aead.TAG_BYTES - 1], b"x") is None


def test_a_key_that_is_not_256_bits_is_refused():
    with pytest.raises(ValueError):
        aead.Box(b"short")


def test_the_gcm_is_openssls_and_answers_the_standards_vector():
    """NIST SP 800-38D (GCM spec) test case 14: AES-256, zero key, 96-bit zero IV, one zero block;
    and the same call from the library hashlib uses, not a copy (mccl_common/libcrypto.py)."""
    from mccl_common import libcrypto
    sealed = libcrypto.gcm_seal(bytes(32), bytes(12), bytes(16), b"")
    assert sealed.hex() == "cea7403d4d606b6e074ec5d3baf39d18" "d0d1c8a799996bf0265b98b5d48ab919"
    assert libcrypto.gcm_open(bytes(32), bytes(12), sealed, b"") == bytes(16)
    assert libcrypto.gcm_open(bytes(32), bytes(12), sealed[:-1] + b"\0", b"") is None
    big = bytes(range(256)) * 4096 + b"tail"
    assert libcrypto.gcm_open(KEY, bytes(12), libcrypto.gcm_seal(KEY, bytes(12), big, b"a"), b"a") == big
    assert libcrypto.gcm_seal(KEY, bytes(12), b"", b"only aad")[:0] == b""
    with pytest.raises(ValueError):
        libcrypto.gcm_seal(KEY, bytes(8), b"x", b"")
