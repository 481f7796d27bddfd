"""torchft on MCCL: a process group torchft's Manager can reconfigure, backed by mccl.

torchft (LocalSGD, DiLoCo, streaming DiLoCo, fault-tolerant HSDP) never calls
``init_process_group``: its Manager builds a new process group from a store address each time
the quorum changes, through a ``torchft.process_group.ProcessGroupWrapper`` subclass that says how
(torchft ships Gloo, NCCL and XCCL ones). This is that subclass for mccl:

    from torchft import Manager
    from torchft.local_sgd import DiLoCo
    import libmccl

    manager = Manager(pg=libmccl.torchft_process_group(), min_replica_size=2, ...)
    with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=32):
        ...                                   # the training loop unchanged

Each quorum gets one mccl communicator over the store torchft hands over, made as any mccl group
is, so the engine's settings, its sealed links and its job-key check apply (with MCCL_DAEMON=1 it
goes through the host's mccld, tested with torchft's DiLoCo); the previous quorum's
communicator is aborted first (torchft's own order), which closes its links and fails whatever it
still had pending.

torchft is optional: without it, asking for the process group raises ConfigError naming the
package. Tested against torchft 0.2.0 (tests/torch/test_torchft.py).
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

from mccl_common import jobkey
from mccl_common.errors import ConfigError
from mccl_common.settings import EngineConfig, load

TESTED_TORCHFT = "0.2.0"


@functools.lru_cache(maxsize=1)
def _wrapper_class() -> type:
    """The ProcessGroupWrapper subclass, built on first use so importing libmccl never needs torchft."""
    try:
        from torchft.process_group import ProcessGroupWrapper
    except ImportError as exc:
        raise ConfigError(f"[mccl] libmccl.torchft_process_group() needs torchft, which cannot be imported ({exc}); "
                          f"install it (tested: pip install --no-deps torchft=={TESTED_TORCHFT} with its "
                          "opentelemetry dependencies), or use libmccl.DiLoCo, which needs no torchft") from exc

    from .. import register
    from .backend import ProcessGroupMCCL

    class ProcessGroupMCCLFT(ProcessGroupWrapper):
        """mccl under torchft's Manager: one communicator per quorum."""

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            register()
            # The quorum names the group in mccl's errors and store keys; torchft already gives
            # each quorum a store prefix of its own.
            name = f"torchft-quorum-{self._quorum_id}" if self._quorum_id is not None else "torchft"
            return ProcessGroupMCCL(store, rank, world_size, self._timeout, group_id=name)

        def getBackendName(self) -> str:
            return "torchft-mccl"

    return ProcessGroupMCCLFT


def torchft_process_group(timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> Any:
    """A reconfigurable mccl process group for ``torchft.Manager(pg=...)``; ``timeout`` bounds each
    op and the set-up of each quorum's communicator (torchft's ProcessGroupWrapper argument)."""
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ConfigError(f"[mccl] torchft_process_group(timeout={timeout!r}): expected a positive datetime.timedelta")
    # torchft catches an error in a quorum's process group and trains on without syncing (the step
    # is simply not committed), so a key that is missing would never stop the script: say it here.
    jobkey.require_job_key(load(EngineConfig).wire_security)
    return _wrapper_class()(timeout=timeout)
