"""The alpha-beta model of the collectives, and time dilation: what the scale benchmark puts
beside every measurement.

A message of ``b`` bytes between two hosts takes ``alpha + b * beta``: alpha the one-way
latency (software plus a switch hop), beta the seconds per byte of the link. For ``n``
bytes over ``N`` ranks (p = the largest power of two <= N; a non-power-of-two N first
folds its extra ranks into the core and unfolds at the end, two more steps of the whole
buffer):

  all_reduce  ring          2(N-1) alpha + 2(N-1)/N n beta
              rd            log2(p) (alpha + n beta)            (recursive doubling)
              rabenseifner  2 log2(p) alpha + 2(p-1)/p n beta   (halving reduce-scatter + doubling all-gather)
              direct        alpha + (N-1) n beta                 (one round: every rank sends to every peer)
  all_gather, reduce_scatter  ring   (N-1) alpha + (N-1)/N n beta
  broadcast   ring          (N-1) alpha + n beta                 (a pipelined chain of small segments)
              direct        alpha + (N-1) n beta

The engine is to grow the same arithmetic (``_core.predict``/``_core.choose_algorithm``) and
a per-communicator measured (alpha, beta) (``Communicator.alpha_beta()``). ``Model`` uses
them where this build has them and this file's formulas otherwise, and says which
(``source``), so a result never passes off one for the other.

Time dilation: a machine that cannot carry N hosts at 10 Gbit/s can carry them at
10/D Gbit/s with D times the latency. Every network time then stretches by D, so
measured / D is the time on the real network; what the CPUs spend per message is not
stretched, so after dividing it counts D times too little (the caveat every dilated
result states).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mccl_common.errors import ConfigError

ALGOS = ("ring", "rd", "rabenseifner", "direct")
# The engine's names of the bench's ops (its Communicator methods).
ENGINE_OP = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reduce_scatter",
             "broadcast": "broadcast"}


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def predict(op: str, algo: str, n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Seconds the model gives one ``op`` of ``nbytes`` (the bench's size S, metrics.py) over
    ``n`` ranks with ``algo``; ValueError for a pair it has no formula for."""
    if n < 1 or nbytes < 0 or alpha < 0 or beta < 0:
        raise ValueError(f"predict: n={n}, nbytes={nbytes}, alpha={alpha}, beta={beta} out of range")
    if n == 1:
        return 0.0
    p = _pow2_floor(n)
    fold = 0.0 if p == n else 2 * (alpha + nbytes * beta)
    steps = math.log2(p)
    if op == "all_reduce":
        if algo == "ring":
            return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta
        if algo == "rd":
            return steps * (alpha + nbytes * beta) + fold
        if algo == "rabenseifner":
            return 2 * steps * alpha + 2 * (p - 1) / p * nbytes * beta + fold
        if algo == "direct":
            return alpha + (n - 1) * nbytes * beta
    elif op in ("all_gather", "reduce_scatter"):
        if algo == "ring":
            return (n - 1) * alpha + (n - 1) / n * nbytes * beta
    elif op == "broadcast":
        if algo == "ring":
            return (n - 1) * alpha + nbytes * beta
        if algo == "direct":
            return alpha + (n - 1) * nbytes * beta
    raise ValueError(f"predict: no formula for {op} with {algo!r}")


def todays_choice(op: str, n: int, nbytes: int, small_allreduce_bytes: int) -> str:
    """The algorithm an engine without ``choose_algorithm`` runs: one round while (N-1) x the
    buffer fits MCCL_SMALL_ALLREDUCE_BYTES (all_reduce, broadcast), the ring otherwise."""
    if op in ("all_reduce", "broadcast") and (n - 1) * nbytes <= small_allreduce_bytes:
        return "direct"
    return "ring"


class Model:
    """The engine's model where this build has it, else this file's; ``source`` says which."""

    def __init__(self, core=None, small_allreduce_bytes: int = 64 << 10):  # noqa: ANN001 - libmccl._core or None
        self._core = core
        self._small = small_allreduce_bytes
        self.source = "engine" if core is not None and hasattr(core, "predict") else "python"
        self.chooser = "engine" if core is not None and hasattr(core, "choose_algorithm") else "python"

    def predict(self, op: str, algo: str, n: int, nbytes: int, alpha: float, beta: float) -> float:
        if self.source == "engine":
            try:
                return float(self._core.predict(ENGINE_OP[op], algo, n, nbytes, alpha, beta))
            except (TypeError, ValueError, RuntimeError):
                pass    # an (op, algo) the engine does not model: the formulas above
        return predict(op, algo, n, nbytes, alpha, beta)

    def choose(self, op: str, n: int, nbytes: int, alpha: float, beta: float) -> str:
        """The algorithm ``auto`` runs for this op."""
        if self.chooser == "engine":
            try:
                return str(self._core.choose_algorithm(ENGINE_OP[op], n, nbytes, alpha, beta))
            except (TypeError, ValueError, RuntimeError):
                pass
        return todays_choice(op, n, nbytes, self._small)


@dataclass(frozen=True)
class Dilation:
    """The network a run stands for (``rate_bits``, one-way ``delay_s`` a hop) and the factor
    ``factor`` by which the emulation slows it: links shaped to rate / factor with
    delay * factor."""

    rate_bits: float
    delay_s: float
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.factor < 1 or self.rate_bits <= 0 or self.delay_s < 0:
            raise ConfigError(f"[bench] dilation {self.factor} of {self.rate_bits:g} bit/s + {self.delay_s:g} s "
                              "is out of range; the factor must be >= 1, the rate > 0, the delay >= 0")

    @property
    def alpha(self) -> float:
        """The real network's alpha (s): the hop's delay (software latency is the engine's)."""
        return self.delay_s

    @property
    def beta(self) -> float:
        """The real network's beta (s/byte)."""
        return 8.0 / self.rate_bits

    @property
    def tc_rate(self) -> str:
        """What the emulated links are shaped to, in tc's syntax (kbit: tc takes integers best)."""
        return f"{max(1, round(self.rate_bits / self.factor / 1e3))}kbit"

    @property
    def tc_delay(self) -> str | None:
        return None if self.delay_s == 0 else f"{max(1, round(self.delay_s * self.factor * 1e6))}us"

    def real(self, measured_s: float) -> float:
        """A time measured on the dilated emulation, converted to the real network's."""
        return measured_s / self.factor

    def dilated(self, real_s: float) -> float:
        return real_s * self.factor


def auto_factor(hosts: int, rate_bits: float, machine_bits: float) -> float:
    """The smallest whole factor at which ``hosts`` links of ``rate_bits`` together fit what
    the machine carries (``machine_bits``, all hosts' traffic together)."""
    if machine_bits <= 0:
        raise ConfigError(f"[bench] machine capacity {machine_bits:g} bit/s must be positive")
    return float(max(1, math.ceil(hosts * rate_bits / machine_bits - 1e-9)))


__all__ = ["ALGOS", "Dilation", "Model", "auto_factor", "predict", "todays_choice"]
