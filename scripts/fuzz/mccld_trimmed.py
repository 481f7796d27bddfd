"""mccld as the fuzzer runs it: the real daemon (``python -m mccld``), plus a SIGUSR2
handler that hands glibc's free heap pages back to the kernel (``malloc_trim``) and says
so in a file.

The fuzzer's memory check is about what the daemon holds, not what the allocator keeps for
later. glibc caches freed memory per thread arena, and how much it keeps varies from run to
run. Trimming before each reading makes the figure the daemon's live memory. (CI twice saw
117 MB of growth where runs here see 17-29 MB. Trimming alone did not explain it: the
final reading also caught a job still closing, which the fuzzer now waits out.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import runpy
import signal
import sys

TRIMMED_SUFFIX = ".trimmed"


def _install(marker: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    trim = getattr(libc, "malloc_trim", None)   # glibc only; elsewhere the readings are untrimmed

    def on_usr2(_sig, _frame) -> None:
        if trim is not None:
            trim(0)
        with open(marker, "a") as f:
            f.write("1" if trim is not None else "0")

    signal.signal(signal.SIGUSR2, on_usr2)


if __name__ == "__main__":
    _install(os.environ["MCCL_RUNTIME_DIR"] + TRIMMED_SUFFIX)
    del sys.path[0]     # this script's folder: the fuzzer's modules must not shadow the daemon's imports
    sys.argv = ["mccld", *sys.argv[1:]]
    runpy.run_module("mccld", run_name="__main__", alter_sys=True)
