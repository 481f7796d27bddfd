"""An attacker on the path between two engine ranks: a proxy on loopback TCP that sits on
every socket of the link between rank 0 and rank 1 (sockets the test hands the engine,
support/borrowed.py) and may rewrite the rank-0-to-1 stream of socket 0 frame by frame.

It knows only what a stranger on the LAN knows: the wire format (a 72-byte header in
clear, then, with wire security on, the header's 16-byte tag and the payload as records
of at most 64 KiB each followed by a 16-byte tag) and the communicator id it reads off
the wire. Everything before the first frame (the link handshake, transport/handshake.cc)
is relayed untouched and at once: its end is known from its messages' lengths, never
guessed from bytes that look like a frame (a random nonce ending in the magic's first
byte once held the dialer's hello back until the handshake timed out).
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Callable

from .borrowed import K, tcp_pair
from .link_peer import HELLO, PROOF, REPLY, VERSION

HEADER = 72
TAG = 16
RECORD = 64 << 10
KIND_COLLECTIVE, KIND_P2P, KIND_ABORT, KIND_BYE = 1, 2, 3, 4


class Frame:
    """One frame as it crossed the wire: header, the header's tag (sealed), and the
    payload's records, each (bytes, tag) (bare frames: one record, tag b"")."""

    def __init__(self, header: bytes, htag: bytes, records: list[tuple[bytes, bytes]]):
        self.header, self.htag, self.records = header, htag, records

    @property
    def kind(self) -> int:
        return struct.unpack_from("<H", self.header, 6)[0]

    @property
    def length(self) -> int:
        return struct.unpack_from("<Q", self.header, 36)[0]

    def wire(self) -> bytes:
        return self.header + self.htag + b"".join(r + t for r, t in self.records)


def header(kind: int, comm_id: int, length: int) -> bytes:
    """A frame header as frame.cc encodes it (seq, tag, offset 0; no signature)."""
    return struct.pack("<IHHQQIQQQ", 0x4C43434D, 2, kind, comm_id, 0, 0, 0, length, length) + bytes(HEADER - 52)


def abort_payload(message: str, kind: int = 1) -> bytes:
    """An ABORT frame's payload (frame.cc encode_abort): origin 0 blames rank 0."""
    m = message.encode()
    return struct.pack("<iiiII", 0, 0, kind, 0, len(m)) + m


def handshake_end(head: bytes) -> int | None:
    """How many of a stream's first bytes are the link handshake, or None while too few
    have arrived to tell (every byte so far is then part of it)."""
    # The dialer sends its hello, then its proof; the acceptor answers each with a reply
    # and as many bytes of reason as the reply says.
    if len(head) < 8:
        return None
    if struct.unpack_from("<I", head, 4)[0] == VERSION:
        return HELLO.size + PROOF.size          # the dialer's side
    if len(head) < 12:
        return None
    first = REPLY.size + struct.unpack_from("<I", head, 8)[0]
    if len(head) < first + 12:
        return None
    return first + REPLY.size + struct.unpack_from("<I", head, first + 8)[0]


# An attack sees each complete frame of the attacked stream, with its number among the
# frames, and returns the bytes to forward instead.
Attack = Callable[[int, Frame], bytes]


class Mitm:
    def __init__(self, sealed: bool, attack: Attack | None = None):
        self.sealed = sealed
        self.attack = attack
        self.captured = bytearray()  # socket 0's rank-0-to-1 bytes as they left rank 0
        self.ends: list[tuple[socket.socket, socket.socket]] = []  # (rank 0's, rank 1's)
        self._mine: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        for s in range(K):
            a0, p0 = tcp_pair()
            p1, b1 = tcp_pair()
            self.ends.append((a0, b1))
            self._mine += [p0, p1]
            self._threads += [threading.Thread(target=self._pump, args=(p0, p1, s == 0), daemon=True),
                              threading.Thread(target=self._pump, args=(p1, p0, False), daemon=True)]
        for t in self._threads:
            t.start()

    def fds(self, r: int) -> dict[int, list[int]]:
        return {1 - r: [pair[r].fileno() for pair in self.ends]}

    def _pump(self, src: socket.socket, dst: socket.socket, attacked: bool) -> None:
        head = bytearray()   # the stream's handshake bytes, until their end is known
        buf = bytearray()    # frame bytes not yet forwarded
        in_frames = False
        n = 0
        try:
            while chunk := src.recv(1 << 16):
                if not attacked:
                    dst.sendall(chunk)
                    continue
                self.captured += chunk
                if not in_frames:
                    sent = len(head)
                    head += chunk
                    end = handshake_end(head)
                    if end is None or len(head) < end:
                        dst.sendall(chunk)
                        continue
                    dst.sendall(bytes(head[sent:end]))
                    chunk = bytes(head[end:])
                    in_frames = True
                buf += chunk
                while (frame := self._take_frame(buf)) is not None:
                    dst.sendall(self.attack(n, frame) if self.attack else frame.wire())
                    n += 1
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _take_frame(self, buf: bytearray) -> Frame | None:
        hlen = HEADER + (TAG if self.sealed else 0)
        if len(buf) < hlen:
            return None
        length = struct.unpack_from("<Q", buf, 36)[0]
        records = -(-length // RECORD)
        body = length + (records * TAG if self.sealed else 0)
        if len(buf) < hlen + body:
            return None
        head, htag = bytes(buf[:HEADER]), bytes(buf[HEADER:hlen])
        pos = hlen
        recs = []
        if not self.sealed:
            recs.append((bytes(buf[pos:pos + length]), b""))
        else:
            for i in range(records):
                rl = min(RECORD, length - i * RECORD)
                recs.append((bytes(buf[pos:pos + rl]), bytes(buf[pos + rl:pos + rl + TAG])))
                pos += rl + TAG
        del buf[:hlen + body]
        return Frame(head, htag, recs)

    def close(self) -> None:
        for a, b in self.ends:
            a.close()
            b.close()
        for s in self._mine:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(10)

    def __enter__(self) -> "Mitm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
