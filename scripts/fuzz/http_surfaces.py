"""The status endpoint (line-framed JSON with HMACs) and the metrics port (HTTP).

status seeds are the requests mcclctl's client code (``status_protocol.query``) sends for
each method, captured from ``Conn.send``. Stages:
  raw       bytes after the server's hello line
  call      a mutated call (method, args) as the body of a request with a valid MAC,
            so mutations reach the dispatcher (the fuzzer holds the fleet key)
  envelope  a mutated request envelope (body, cnonce, mac); placeholders left in it
            are filled with a real call, a fresh client nonce and a valid MAC

metrics seeds are requests as Prometheus sends them (a scrape, with its headers), held
as (method, path, version, headers, body) and rendered after mutation. Stages: raw, http.
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import strategies as st

from mccld.net import linktest
from mccl_common import status_protocol as sp

from .mutate import byte_noise, encode, mutated_json, random_bytes
from .surfaces import ANSWER_TIMEOUT_S, Input, Surface, Verdict, connect, json_line, send_and_close
from .target import FLEET_KEY

_KEY = FLEET_KEY.encode()
LINKTEST_ANSWER_S = linktest.MAX_SECONDS + 2 * sp.IO_TIMEOUT_S + ANSWER_TIMEOUT_S


class StatusSurface(Surface):
    name = "status"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.daemon.status_port}"

    def capture(self) -> None:
        sent: list[dict[str, Any]] = []
        real_send = sp.Conn.send

        def recording(conn, obj):
            sent.append(json.loads(json.dumps(obj)))
            return real_send(conn, obj)
        sp.Conn.send = recording
        try:
            for method in sp.READ_METHODS:
                sp.query(self.addr, _KEY, method, {}, timeout_s=20.0)
        finally:
            sp.Conn.send = real_send
        calls = [json.loads(m["body"]) for m in sent]
        calls += [{"method": "linktest", "args": {"target": self.addr, "seconds": 0.2, "streams": 1}},
                  {"method": sp.SINK, "args": {"seconds": 0.1}}]
        self.seeds = {"call": calls, "envelope": [{"body": "$BODY", "cnonce": "$CNONCE", "mac": "$MAC"}, sent[0]]}

    def strategy(self) -> st.SearchStrategy[Input]:
        call = mutated_json(self.seeds["call"]).map(encode).map(lambda b: Input(self.name, "call", [b]))
        env = mutated_json(self.seeds["envelope"]).map(encode).map(lambda b: Input(self.name, "envelope", [b]))
        raw = st.one_of(random_bytes, random_bytes.map(lambda b: b + b"\n")).map(
            lambda b: Input(self.name, "raw", [b]))
        return st.one_of(call, call, env, raw)

    def send(self, inp: Input) -> Verdict:
        sock = connect(self.addr)
        try:
            hello = sp.Conn(sock, self.addr).recv("hello")
        except (OSError, ConnectionError, sp.ProtocolError):
            sock.close()
            return Verdict(True, detail="closed before its hello")
        nonce = str(hello.get("nonce"))
        if inp.stage == "raw":
            return send_and_close(sock, inp.frames[0])
        if inp.stage == "call":
            body = inp.frames[0].decode("utf-8", "surrogatepass")
            # A linktest measures for up to MAX_SECONDS (and its target, here often this very
            # daemon, serves the sink as long): answered late is still answered.
            wait = LINKTEST_ANSWER_S if b"linktest" in inp.frames[0] else ANSWER_TIMEOUT_S
            return send_and_close(sock, json_line(_signed(nonce, body)), wait)
        try:
            env = json.loads(inp.frames[0])
        except (ValueError, RecursionError):
            return send_and_close(sock, inp.frames[0] + b"\n")
        return send_and_close(sock, json_line(_fill(env, nonce)))


def _signed(nonce: str, body: str, cnonce: str | None = None) -> dict[str, str]:
    cnonce = cnonce if cnonce is not None else os.urandom(16).hex()
    return {"body": body, "cnonce": cnonce, "mac": sp.mac(_KEY, "req", nonce, cnonce, body)}


def _fill(env: Any, nonce: str) -> Any:
    if not isinstance(env, dict):
        return env
    env = dict(env)
    if env.get("body") == "$BODY":
        env["body"] = sp.canon({"method": "status", "args": {}})
    if env.get("cnonce") == "$CNONCE":
        env["cnonce"] = os.urandom(16).hex()
    if env.get("mac") == "$MAC" and isinstance(env.get("body"), str) and isinstance(env.get("cnonce"), str):
        try:
            env["mac"] = sp.mac(_KEY, "req", nonce, env["cnonce"], env["body"])
        except UnicodeError:
            pass
    return env


class MetricsSurface(Surface):
    name = "metrics"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.daemon.metrics_port}"

    def capture(self) -> None:
        host = self.addr
        scrape = {"method": "GET", "path": "/metrics", "version": "HTTP/1.1", "headers": [
            ["Host", host], ["User-Agent", "Prometheus/2.53.0"],
            ["Accept", "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.1"],
            ["Accept-Encoding", "gzip"], ["X-Prometheus-Scrape-Timeout-Seconds", "10"]], "body": ""}
        self.seeds = {"http": [
            scrape,
            {**scrape, "path": "/metrics?name[]=mccl_errors_total&name[]=mccl_uptime_seconds"},
            {**scrape, "method": "HEAD", "path": "/"},
            {**scrape, "method": "POST", "headers": scrape["headers"] + [["Content-Length", "5"]], "body": "hello"},
            {"method": "GET", "path": "/", "version": "HTTP/1.0", "headers": [], "body": ""}]}
        # The seeds are what a scraper sends: the first one must be answered (gzipped, as asked).
        sock = connect(self.addr)
        sock.sendall(_render(scrape))
        sock.shutdown(1)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
        sock.close()
        if not got.startswith(b"HTTP/1.0 200 ") or b"Content-Encoding: gzip" not in got:
            raise RuntimeError(f"[fuzz] the metrics seed scrape was not served: {got[:200]!r}")

    def strategy(self) -> st.SearchStrategy[Input]:
        http = mutated_json(self.seeds["http"]).map(_render).flatmap(byte_noise).map(
            lambda b: Input(self.name, "http", [b]))
        return st.one_of(http, http, http, random_bytes.map(lambda b: Input(self.name, "raw", [b])))

    def send(self, inp: Input) -> Verdict:
        return send_and_close(connect(self.addr), inp.frames[0])


def _text(v: Any) -> bytes:
    return (v if isinstance(v, str) else json.dumps(v, allow_nan=True)).encode("utf-8", "surrogatepass")


def _render(req: Any) -> bytes:
    """An HTTP request from its parts; a part mutated into another type is written as its JSON."""
    if not isinstance(req, dict):
        return encode(req)
    lines = [b" ".join(_text(req.get(k, "")) for k in ("method", "path", "version"))]
    headers = req.get("headers")
    for h in headers if isinstance(headers, list) else [headers]:
        if isinstance(h, list) and len(h) == 2:
            lines.append(_text(h[0]) + b": " + _text(h[1]))
        else:
            lines.append(_text(h))
    return b"\r\n".join(lines) + b"\r\n\r\n" + _text(req.get("body", ""))
