"""Another local user for the attacker tests: ``as_user(uid, gid, fn)`` runs ``fn`` in a forked
child that dropped to that uid and gid (the tests run as root), and returns what it returned,
or the repr of what it raised. The child shares nothing with the test but what fork copied."""

from __future__ import annotations

import os
import pickle
import select
import signal
import traceback
from typing import Any, Callable

ATTACKER_UID = 12345     # "another local user": no passwd entry, in no group
VICTIM_UID = 12346


def as_user(uid: int, gid: int, fn: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = ("ok", fn())
            except BaseException as e:   # noqa: BLE001 - the parent asserts on it
                out = ("raised", f"{type(e).__name__}: {e}", traceback.format_exc())
            os.write(w, pickle.dumps(out))   # our own child's result, never a peer's
        except BaseException:   # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        chunks = []
        while True:
            ready, _, _ = select.select([r], [], [], timeout_s)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                raise TimeoutError(f"the child as uid {uid} did not finish in {timeout_s}s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    if not chunks:
        raise RuntimeError(f"the child as uid {uid} died without a result")
    return pickle.loads(b"".join(chunks))
