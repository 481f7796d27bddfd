"""What the lm workload compares: each variant is a torch.distributed backend plus the
environment its ranks get, nothing else, so a new mode of the engine is one more entry.

A variant lists the MCCL_* settings it ``requires``: the installed mccl must declare each of
them (mccl_common.settings) and accept its value, or the run stops before any rank starts. An
mccl that does not know MCCL_COMPRESSION would otherwise run ``int8`` uncompressed and report
fp32's curve under int8's name. ``off`` requires nothing: uncompressed is what an mccl without
compression does anyway, so it is set when known and honest when not. After a run on an
emulated fleet the harness also checks that a compressed variant put fewer bytes on the wire
than fp32 would (runner.check_wire). A ``daemon`` variant runs its ranks through one mccld per
host, started for it with the same settings.

A ``diloco`` variant trains without DDP: each rank steps its own batch with the same AdamW, and
``libmccl.DiLoCo`` (outer SGD lr 0.7, momentum 0.9, Nesterov) synchronizes every H inner steps,
in F fragments with a delay tau and a mixing factor alpha for streaming; its outer gradients are
compressed when the variant's MCCL_COMPRESSION says so (DiLoCo(compression=...) checks the group).
An ``adaptive`` one plans each rank's inner steps per round by its speed (DiLoCo(adaptive=True)),
so its ranks make different numbers of steps and the run is counted in rounds (steps / H).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mccl_common.errors import ConfigError


@dataclass(frozen=True)
class Variant:
    name: str
    backend: str                                    # "gloo" or "mccl"
    env: dict = field(default_factory=dict)         # set in every rank's environment
    requires: tuple = ()                            # MCCL_* settings the installed mccl must declare
    wire_factor: float = 1.0                        # expected wire bytes relative to fp32 (for check_wire)
    label: str = ""
    daemon: bool = False                            # through one mccld per host (MCCL_DAEMON=1)
    balanced: bool = False                          # speed-aware shares (libmccl.training.SpeedBalancer)
    diloco: dict | None = None                      # {"H", "F", "tau", "alpha", "compression"}: no DDP

    def to_dict(self) -> dict:
        return {"name": self.name, "backend": self.backend, "env": dict(self.env), "label": self.label or self.name,
                "requires": list(self.requires), "wire_factor": self.wire_factor, "daemon": self.daemon,
                "balanced": self.balanced, "diloco": None if self.diloco is None else dict(self.diloco)}


_COMP, _EF = "MCCL_COMPRESSION", "MCCL_COMPRESSION_ERROR_FEEDBACK"


def _diloco(name: str, h: int, f: int = 1, tau: int = 0, alpha: float = 0.0, comp: str | None = None,
            adaptive: bool = False) -> Variant:
    """One outer gradient (the parameters' bytes) every H/F inner steps per fragment of 1/F of
    them: 1/H of DDP's gradient bytes per step, times the compressed size."""
    env = {_COMP: comp or "off"}
    requires: tuple = ()
    if comp:
        env[_EF] = "1"
        requires = (_COMP, _EF)
    factor = {None: 1.0, "bf16": 0.5, "fp16": 0.5, "int8": 0.25}[comp] / h
    what = f"H={h}" + (f", F={f}, tau={tau}, alpha={alpha}" if f > 1 or tau else "") + (f", {comp} outer" if comp else "")
    what += ", inner steps by speed" if adaptive else ""
    cfg = {"H": h, "F": f, "tau": tau, "alpha": alpha, "compression": comp}
    if adaptive:
        cfg["adaptive"] = True
    return Variant(name, "mccl", env, requires, factor, f"mccl, DiLoCo {what}", diloco=cfg)


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("gloo", "gloo", label="Gloo DDP (fp32)"),
    Variant("off", "mccl", {_COMP: "off"}, label="mccl, fp32 (compression off)"),
    Variant("bf16", "mccl", {_COMP: "bf16"}, (_COMP,), 0.5, "mccl, bf16"),
    Variant("fp16", "mccl", {_COMP: "fp16"}, (_COMP,), 0.5, "mccl, fp16"),
    Variant("int8", "mccl", {_COMP: "int8", _EF: "1"}, (_COMP, _EF), 0.25, "mccl, int8 + error feedback"),
    Variant("int8-nofb", "mccl", {_COMP: "int8", _EF: "0"}, (_COMP, _EF), 0.25, "mccl, int8, no error feedback"),
    # Through mccld: the harness starts one daemon per host for the variant, with the same settings.
    Variant("off-daemon", "mccl", {_COMP: "off"}, label="mccl through mccld, fp32", daemon=True),
    Variant("int8-daemon", "mccl", {_COMP: "int8", _EF: "1"}, (_COMP, _EF), 0.25,
            "mccl through mccld, int8 + error feedback", daemon=True),
    # Each rank's share of the global batch by its measured speed, the gradient weighted by samples.
    Variant("balanced", "mccl", {_COMP: "off"}, label="mccl, fp32, speed-balanced shares", balanced=True),
    Variant("gloo-balanced", "gloo", label="Gloo DDP (fp32), speed-balanced shares", balanced=True),
    # DiLoCo (issue 35): no DDP, an outer step every H inner steps.
    _diloco("diloco-h8", 8),
    # Each rank's inner steps per round by its measured speed (issue 37): a slow host does not hold the round.
    _diloco("diloco-h8-adaptive", 8, adaptive=True),
    _diloco("diloco-h32", 32),
    _diloco("diloco-h32-int8", 32, comp="int8"),
    _diloco("streaming-f4", 32, f=4, tau=1, alpha=0.5),
)}
DEFAULT = ("gloo", "off", "bf16", "int8", "int8-nofb")


def declared_settings() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every MCCL_* variable the installed mccl declares: env name -> (settings class, field)."""
    from mccl_common import settings

    # The engine's settings (MCCL_COMPRESSION among them) are declared in mccl_common itself; the
    # harness stays free of torch and of the daemon's dependencies.
    return {f.metadata["env"]: (cls, f) for cls in settings.ALL_SETTINGS for f in dataclasses.fields(cls)}


def resolve(names: list[str], declared: dict | None = None) -> list[Variant]:
    """The named variants, each checked against the installed mccl; ConfigError names the first
    that cannot run as asked."""
    from mccl_common import settings

    if not names:
        raise ConfigError(f"[bench] no --variants given; choose from {', '.join(VARIANTS)}")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ConfigError(f"[bench] unknown lm variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"[bench] --variants {','.join(names)} names a variant twice")
    declared = declared_settings() if declared is None else declared
    out = []
    for n in names:
        v = VARIANTS[n]
        missing = [s for s in v.requires if s not in declared]
        if missing:
            raise ConfigError(
                f"[bench] variant {n!r} needs {', '.join(missing)}, which the installed mccl does not declare "
                "(mccl_common/settings.py): it would run uncompressed and report fp32's curve as "
                f"{n}'s; build an mccl with compression, or leave {n} out of --variants")
        env = {k: val for k, val in v.env.items() if k in declared or k not in v.requires}
        # Each value goes through the setting's own parser and checks, as the engine will read it.
        by_cls: dict[type, dict[str, str]] = {}
        for k, val in env.items():
            if k in declared:
                by_cls.setdefault(declared[k][0], {})[k] = val
        for cls, vals in by_cls.items():
            try:
                settings.load(cls, vals)
            except ConfigError as e:
                raise ConfigError(f"[bench] variant {n!r}: the installed mccl refuses its setting: {e}") from None
        out.append(dataclasses.replace(v, env=env))
    return out
