"""The record cipher that seals the engine's frames (libmccl/csrc/integrity/aead.*): OpenSSL's
AES-256-GCM against the GCM specification's known answers, and the properties the
transport relies on: a changed byte, header, record number, stream, key or direction makes
a record fail to open, and mac mode authenticates without encrypting."""

from __future__ import annotations

import os

import pytest

from libmccl import _core
from mccl_common.errors import ConfigError

H = bytes.fromhex
W = _core.WireSecurity


def sealer(mode=W.aead, key=bytes(32)):
    return _core.RecordCipher(mode, key, True)


def opener(mode=W.aead, key=bytes(32)):
    return _core.RecordCipher(mode, key, False)


def test_aes_256_gcm_known_answers():
    # McGrew & Viega, "The Galois/Counter Mode of Operation", test cases 13 and 14: a zero
    # key and a zero 96-bit IV, which is this cipher's nonce for record 0 of stream 0.
    assert sealer().seal(0, b"", b"")[1] == H("530f8afbc74536b9a963b4f1c4cb738b")
    ct, tag = sealer().seal(0, b"", bytes(16))
    assert ct == H("cea7403d4d606b6e074ec5d3baf39d18")
    assert tag == H("d0d1c8a799996bf0265b98b5d48ab919")


def test_records_open_in_order_and_any_change_fails():
    key = os.urandom(32)
    aad = os.urandom(72)
    records = [os.urandom(n) for n in (1, 1000, _core.RECORD_BYTES, 0)]
    s = sealer(key=key)
    sealed = [s.seal(0, aad, r) for r in records]
    # Encrypted: a 1-byte record's ciphertext equals its plaintext 1 time in 256 (ci15 drew it),
    # so the comparison is of the records long enough that a match would mean no encryption.
    assert all(ct != r for (ct, _), r in zip(sealed, records) if len(r) >= 16)
    o = opener(key=key)
    assert [o.open(0, aad, ct, tag) for ct, tag in sealed] == records

    def opens(i, ct=None, tag=None, aad_=aad, stream=0):
        o = opener(key=key)
        for ct_j, tag_j in sealed[:i]:
            assert o.open(0, aad, ct_j, tag_j) is not None
        c, t = sealed[i]
        return o.open(stream, aad_, c if ct is None else ct, t if tag is None else tag) is not None

    assert opens(1)
    flipped = bytearray(sealed[1][0])
    flipped[500] ^= 1
    assert not opens(1, ct=bytes(flipped))                      # a changed byte
    assert not opens(1, tag=bytes(16))                          # a forged tag
    assert not opens(1, aad_=bytes([aad[0] ^ 1]) + aad[1:])       # another header (b"\x01" + ... was aad itself 1 time in 256: ci19)
    assert not opens(1, stream=1)                               # the control stream
    assert opener(key=os.urandom(32)).open(0, aad, *sealed[0]) is None  # another key
    assert not opens(2, ct=sealed[1][0], tag=sealed[1][1])      # replayed one record later
    o = opener(key=key)
    assert o.open(0, aad, *sealed[1]) is None                   # record 1 where 0 belongs (drop)


def test_mac_mode_authenticates_without_encrypting():
    key = os.urandom(32)
    data = os.urandom(5000)
    ct, tag = sealer(W.mac, key).seal(0, b"hdr", data)
    assert ct == data
    assert opener(W.mac, key).open(0, b"hdr", data, tag) == data
    assert opener(W.mac, key).open(0, b"hdr", data[:-1] + bytes([data[-1] ^ 1]), tag) is None
    # GMAC is not the AEAD's tag: a mac-mode tag does not open in aead mode.
    assert opener(W.aead, key).open(0, b"hdr", data, tag) is None


def test_bad_arguments_are_refused():
    with pytest.raises(ConfigError, match="32 bytes"):
        _core.RecordCipher(W.aead, bytes(31), True)
    with pytest.raises(ConfigError, match="mac or aead"):
        _core.RecordCipher(W.off, bytes(32), True)
    with pytest.raises(ConfigError, match="64 KiB"):
        sealer().seal(0, b"", bytes(_core.RECORD_BYTES + 1))


def test_cost_measurement_runs():
    s = _core.record_seconds_per_byte(W.aead, False, 4 << 20, 3)
    o = _core.record_seconds_per_byte(W.aead, True, 4 << 20, 3)
    # Above 200 MB/s even on a loaded core: OpenSSL's AES-NI/PCLMUL code does ~3 GB/s.
    assert 0 < s < 5e-9 and 0 < o < 5e-9
