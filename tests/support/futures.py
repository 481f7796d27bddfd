"""Waiting on a c10 future the way torch's C++ does (DDP's reducer, comm hooks)."""

from __future__ import annotations

import warnings
from typing import Any

import torch


def _cxx_wait_fn(fut: torch.jit.Future[Any]) -> bool:
    torch.jit.wait(fut)
    return True


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated, still a C++ reader
    _cxx_wait = torch.jit.script(_cxx_wait_fn)


def cxx_wait(fut: Any) -> None:
    """Wait on ``fut`` the way C++ does; raises if the c10 future holds an error."""
    _cxx_wait(fut)
