"""The frame MAC's primitives (libmccl/csrc/integrity/mac.*) against RFC 8439's test vectors,
and the properties the transport will rely on: a changed byte, header, frame number or
stream changes the tag."""

from __future__ import annotations

import random

import pytest

from libmccl import _core

H = bytes.fromhex


def test_chacha20_block_rfc8439_2_3_2() -> None:
    key = bytes(range(32))
    nonce = H("000000090000004a00000000")
    out = _core.chacha20_block(key, 1, nonce)
    assert out == H("10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
                    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e")


def test_poly1305_rfc8439_2_5_2() -> None:
    key = H("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    assert _core.poly1305(key, b"Cryptographic Forum Research Group") == H("a8061dc1305136c6c22b8baf0c0127a9")


def test_poly1305_key_generation_rfc8439_2_6_2() -> None:
    key = H("808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f")
    nonce = H("000000000001020304050607")
    assert _core.chacha20_block(key, 0, nonce)[:32] == H(
        "8ad5a08b905f81cc815040274ab29471a833b637e3fd0da508dbb8e2fdd1a646")


@pytest.mark.parametrize("msg, tag", [
    # RFC 8439 A.3 #1: all-zero key and message
    (bytes(64), "00000000000000000000000000000000"),
])
def test_poly1305_rfc8439_a3(msg, tag) -> None:
    assert _core.poly1305(bytes(32), msg) == H(tag)


def test_poly1305_edge_vectors_rfc8439_a3_5_to_11() -> None:
    # Vectors exercising the final reduction (h >= p) and the limb carries.
    cases = [
        ("02" + "00" * 31, "ff" * 16, "03" + "00" * 15),
        ("02" + "00" * 15 + "ff" * 16, "02" + "00" * 15, "03" + "00" * 15),
        ("01" + "00" * 31, "ff" * 16 + "f0" + "ff" * 15 + "11" + "00" * 15, "05" + "00" * 15),
        ("01" + "00" * 31, "ff" * 16 + "fb" + "fe" * 15 + "01" * 16, "00" * 16),
        ("02" + "00" * 31, "fd" + "ff" * 15, "fa" + "ff" * 15),
    ]
    for key, msg, tag in cases:
        assert _core.poly1305(H(key), H(msg)) == H(tag), (key, msg)


def test_poly1305_pieces_equal_the_whole() -> None:
    rnd = random.Random(3)
    key = bytes(rnd.randrange(256) for _ in range(32))
    for n in (0, 1, 15, 16, 17, 71, 72, 73, 4096, 4099):
        body = bytes(rnd.randrange(256) for _ in range(n))
        for cut in {0, n // 3, n}:
            header, payload = body[:cut], body[cut:]
            # frame_tag(header, payload) is Poly1305 over header + payload under the derived key
            otk = _core.chacha20_block(key, 0, (7).to_bytes(4, "little") + (9).to_bytes(8, "little"))[:32]
            assert _core.frame_tag(key, 7, 9, header, payload) == _core.poly1305(otk, body)


def test_any_change_changes_the_tag() -> None:
    key = bytes(range(32))
    header, payload = bytes(72), bytes(range(256)) * 16
    base = _core.frame_tag(key, 1, 5, header, payload)
    flipped = bytearray(payload)
    flipped[1000] ^= 1
    assert _core.frame_tag(key, 1, 5, header, bytes(flipped)) != base
    assert _core.frame_tag(key, 1, 5, b"\x01" + header[1:], payload) != base
    assert _core.frame_tag(key, 1, 6, header, payload) != base   # a replayed frame under a later number
    assert _core.frame_tag(key, 2, 5, header, payload) != base   # the other direction
    assert _core.frame_tag(bytes(31) + b"\x01", 1, 5, header, payload) != base


def test_bad_lengths_are_config_errors() -> None:
    from mccl_common.errors import ConfigError

    with pytest.raises(ConfigError, match="key must be 32 bytes"):
        _core.poly1305(bytes(16), b"x")
    with pytest.raises(ConfigError, match="nonce must be 12 bytes"):
        _core.chacha20_block(bytes(32), 0, bytes(8))


def test_throughput_measurement_runs() -> None:
    s = _core.frame_tag_seconds_per_byte(1 << 20, 8 << 20, 1)
    assert 0 < s < 1e-6  # slower than 1 MB/s would be a broken build, not a slow machine
