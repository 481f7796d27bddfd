"""Per-group settings: ``init_process_group("mccl", pg_options=libmccl.Options(...))``.

The MCCL_* environment variables configure every group of a process alike; a group that
needs different engine settings (more sockets per peer for a large data-parallel group,
say) passes them here. Names are EngineConfig's field names, values are in its units, and
an explicit option wins over the environment. Anything torch hands the backend that is not
an ``Options`` is refused rather than ignored: a setting that silently does nothing is
worse than an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mccl_common.errors import ConfigError
from mccl_common.settings import EngineConfig

# EngineConfig's annotations are strings (postponed evaluation); the accepted Python types.
_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


class Options:
    """Overrides of EngineConfig fields for one process group, e.g.
    ``Options(sockets_per_peer=4, segment_bytes=1 << 20)``."""

    __slots__ = ("_overrides",)

    def __init__(self, **overrides: Any) -> None:
        fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
        for name, value in overrides.items():
            f = fields.get(name)
            if f is None:
                raise ConfigError(f"[mccl] Options({name}=...) is not an engine setting; valid names: "
                                  f"{', '.join(sorted(fields))} (see the settings table in README.md)")
            accepted = _TYPES.get(str(f.type), (object,))
            if not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted):
                raise ConfigError(f"[mccl] Options({name}={value!r}): expected {f.type} "
                                  f"({f.metadata['unit']}), got {type(value).__name__}")
        self._overrides = dict(overrides)

    @property
    def overrides(self) -> dict[str, Any]:
        return dict(self._overrides)

    def apply(self, cfg: EngineConfig) -> EngineConfig:
        """``cfg`` with these overrides, range-checked like the environment is."""
        new = dataclasses.replace(cfg, **self._overrides)
        try:
            new.validate()
        except ConfigError as exc:
            raise ConfigError(f"[mccl] {self!r} rejected: {exc}") from None
        return new

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and other._overrides == self._overrides

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._overrides.items())))

    def __repr__(self) -> str:
        return "Options(" + ", ".join(f"{k}={v!r}" for k, v in sorted(self._overrides.items())) + ")"
