"""A c10d store whose values carry MACs (mccl_common/store_auth.py), for code that is not ours.

torch's rendezvous handler and torchrun's agents read values from the round store and act on
them (MASTER_ADDR/PORT, the ranks each agent is assigned); the daemon client reads its peers'
link addresses. Handing them a ``SealedStore`` instead of the raw store seals every value they
``set`` and checks every value they ``get`` under the scope's key, with the full key name (the
PrefixStore prefixes included) bound into the MAC. Counters (``add``), presence (``check``,
``wait``) and deletes pass through (``ForwardingStore``): they carry no value to forge.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch.distributed as dist

from mccl_common import store_auth
from mccl_common.errors import StoreAuthError


class ForwardingStore(dist.Store):
    """A c10d store written in Python over ``inner``: every call goes to ``_store()`` (``inner``
    unless a subclass picks another), so a subclass overrides only the calls it changes. torch
    calls a Python store's methods by name; one it lacks fails as "not implemented"."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def _store(self) -> Any:
        return self.inner

    def set(self, key: str, value: Any) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return self._store().get(key)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._store().multi_set(keys, values)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._store().multi_get(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._store().compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._store().add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store().check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self._store().delete_key(key)

    def num_keys(self) -> int:
        return self._store().num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)
        super().set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout


class SealedStore(ForwardingStore):
    """``inner`` with sealed values. ``peer`` names the store's server in errors."""

    def __init__(self, inner: Any, key: bytes | None, peer: str, component: str = "rendezvous",
                 error: Callable[..., Exception] = StoreAuthError) -> None:
        super().__init__(inner)
        self._key = key
        self._peer = peer
        self._component = component
        self._error = error

    # Hooks for a store whose key and namespace are known only later (the anchor's store takes
    # them from the run's epoch, libmccl/elastic/rdzv.py).
    def _mac_key(self) -> bytes | None:
        return self._key

    def _open(self, name: str, blob: bytes) -> bytes:
        return store_auth.open(self._mac_key(), name, blob, self._peer, self._component, self._error)

    @staticmethod
    def _bytes(value: Any) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set(self, key: str, value: Any) -> None:
        self._store().set(key, store_auth.seal(self._mac_key(), key, self._bytes(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, self._store().get(key))

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        key = self._mac_key()
        self._store().multi_set(keys, [store_auth.seal(key, k, self._bytes(v)) for k, v in zip(keys, values)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self._open(k, v) for k, v in zip(keys, self._store().multi_get(keys))]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        # A compare-and-set over a sealed value needs the sealed bytes it replaces: only the
        # empty "create if missing" form can be expressed without them.
        if self._bytes(expected):
            raise NotImplementedError("SealedStore.compare_set: only the create-if-missing form (expected '')")
        sealed = store_auth.seal(self._mac_key(), key, self._bytes(desired))
        return self._open(key, self._store().compare_set(key, "", sealed))


__all__ = ["ForwardingStore", "SealedStore"]
