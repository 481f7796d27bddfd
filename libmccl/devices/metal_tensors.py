"""torch glue of the Metal bridge: which ``MetalOps`` serve an mps tensor, and at what address.

``MCCL_UNIFIED_COLLECTIVE`` decides whether mps tensors use the bridge at all: ``auto`` (the
default) where it loads, ``1`` always (a ConfigError names the missing piece), ``0`` never
(mps tensors then stage through blocking CPU copies, ``libmccl.devices.unified``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from mccl_common.errors import ConfigError
from mccl_common.settings import EngineConfig, load
from .metal_ops import CBridge, MetalDevice, MetalOps, bridge_path

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_device: MetalDevice | None = None
_failure: ConfigError | None = None
_told_fallback = False

MODES = ("auto", "1", "0")


def mode() -> str:
    value = str(load(EngineConfig).unified_collective).strip().lower()
    value = {"true": "1", "on": "1", "yes": "1", "false": "0", "off": "0", "no": "0"}.get(value, value)
    if value not in MODES:
        raise ConfigError(f"[config] MCCL_UNIFIED_COLLECTIVE={value!r} is not one of auto, 1, 0; "
                          "fix or unset it (see the settings table in README.md)")
    return value


def _open() -> MetalDevice:
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.dylib")
    return MetalDevice(CBridge(bridge_path(), torch_lib))


def device() -> MetalDevice:
    """This process's Metal device; the first failure is remembered and raised again."""
    global _device, _failure
    with _lock:
        if _device is None and _failure is None:
            try:
                if not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
                    raise ConfigError("[metal] torch reports MPS unavailable (not Apple silicon, or a torch "
                                      "build without MPS)")
                _device = _open()
            except ConfigError as exc:
                _failure = exc
        if _device is None:
            assert _failure is not None
            raise _failure
        return _device


def ops_for(t: torch.Tensor, what: str) -> tuple[MetalOps, int] | None:
    """(ops, address) ordering ``t``'s collective on torch's MPS stream, or None where mps
    tensors stage through blocking copies instead (``MCCL_UNIFIED_COLLECTIVE``)."""
    m = mode()
    if m == "0":
        return None
    global _told_fallback
    try:
        dev = device()
    except ConfigError as exc:
        if m == "1":
            raise
        with _lock:
            tell, _told_fallback = not _told_fallback, True
        if tell:
            _log.info("mps tensors stage through blocking CPU copies: %s", exc)
        return None
    nbytes = t.numel() * t.element_size()
    # torch's MPS storage pointer is its id<MTLBuffer>; data_ptr adds the byte offset.
    ops, addr, note = dev.place(t.untyped_storage().data_ptr(), t.data_ptr(), nbytes, what)
    if note:
        _log.info("%s", note)
    return ops, addr


def reset_for_tests(dev: Any = None) -> None:
    """Forget the loaded (or failed) bridge; tests install a device over a fake bridge."""
    global _device, _failure
    with _lock:
        _device, _failure = dev, None
