"""The round's store as torchrun's agents see it: their rank table does not wait for a host gone.

Right after a round forms, torch's agent (``SimpleElasticAgent._assign_worker_ranks``) writes
its role info, agent 0 reads every agent's with one blocking ``multi_get`` and writes the rank
table, and the others block on ``get`` for their row. A host that leaves in that moment (its
user came back and mccld removed the job) never writes its part: the others wait out the
store's timeout, torch raises ``DistStoreError`` there, outside anything that would start a new
round, and every host's torchrun fails.

``AssignmentStore`` waits for those keys in short slices instead, and asks the handler after
each whether a host of this round has left (its keep-alives stopped). Once one has, it answers
for it: a missing agent's role info is this agent's own with the missing group rank (torchrun
starts the same number of workers on every host), and a row agent 0 never wrote is computed the
way torch computes it. The workers then start in a round that is short one host; the handler
reports that (``num_nodes_waiting``) at the agent's next look and torchrun restarts them in a
round without it, as it would for a host lost a moment later. Nothing here is believed from the
network that the sealed store under it did not authenticate; the values made up stand only for
a host the rendezvous already counts as gone.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from ..sealed_store import ForwardingStore

# torch's names (torch/distributed/elastic/agent/server/api.py, _assign_worker_ranks).
ROLE_INFO = "torchelastic/role_info/"
ASSIGNED_RANKS = "torchelastic/assigned_ranks/"
_POLL_FIRST_S = 0.05
_POLL_MAX_S = 0.5


class AssignmentStore(ForwardingStore):
    """``inner`` (the round's store), with ``get``/``multi_get`` of the agents' rank table keys
    answered for hosts that ``gone()`` (group ranks of this round whose keep-alives stopped)
    names. ``timeout_error(message)`` builds the error raised when the keys neither came nor
    were answered for within the store's timeout."""

    def __init__(self, inner: Any, world_size: int, gone: Callable[[], set[int]],
                 timeout_error: Callable[[str], Exception]) -> None:
        super().__init__(inner)
        self._world = world_size
        self._gone = gone
        self._timeout_error = timeout_error
        self._own_role: dict | None = None   # this agent's role info, as it wrote it

    # --- the rank table ------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        if key.startswith(ROLE_INFO):
            try:
                self._own_role = json.loads(bytes(value if not isinstance(value, str) else value.encode()))
            except ValueError:
                self._own_role = None
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        if key.startswith(ASSIGNED_RANKS):
            row = self._await([key], lambda missing, gone: self._row_for(key, gone))
            if row is not None:
                return row[0]
        return self.inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if keys and all(k.startswith(ROLE_INFO) for k in keys):
            made = self._await(keys, lambda missing, gone: self._role_infos_for(keys, missing, gone))
            if made is not None:
                return made
        return self.inner.multi_get(keys)

    def _await(self, keys: list[str], answer: Callable[[list[str], set[int]], list[bytes] | None]
               ) -> list[bytes] | None:
        """None once every key is in the store (read it as usual); else what ``answer`` makes up
        once a host of the round is gone."""
        deadline = time.monotonic() + self.inner.timeout.total_seconds()
        pause = _POLL_FIRST_S
        while True:
            missing = [k for k in keys if not self.inner.check([k])]
            if not missing:
                return None
            gone = self._gone()
            if gone:
                made = answer(missing, gone)
                if made is not None:
                    return made
            if time.monotonic() >= deadline:
                raise self._timeout_error(
                    f"torchrun's agents did not finish assigning the workers' ranks within "
                    f"{self.inner.timeout.total_seconds():g}s: {', '.join(missing[:4])} never written")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _role_infos_for(self, keys: list[str], missing: list[str], gone: set[int]) -> list[bytes] | None:
        """Agent 0's read of every agent's role info, the gone ones' made from this agent's."""
        ranks = {k: int(k[len(ROLE_INFO):]) for k in missing}
        if self._own_role is None or not set(ranks.values()) <= gone:
            return None        # a live host has not written yet: keep waiting for it
        return [self._role_info(ranks[k]) if k in ranks else self.inner.get(k) for k in keys]

    def _role_info(self, group_rank: int) -> bytes:
        own = dict(self._own_role or {})
        own["rank"] = group_rank
        return json.dumps(own).encode()

    def _row_for(self, key: str, gone: set[int]) -> list[bytes] | None:
        """This agent's row of a table agent 0 will never write (its host is gone), computed
        as torch computes it from the role infos (the gone hosts' made up)."""
        if 0 not in gone or self._own_role is None:
            return None
        infos = []
        for r in range(self._world):
            k = f"{ROLE_INFO}{r}"
            infos.append(json.loads(self.inner.get(k)) if self.inner.check([k]) else json.loads(self._role_info(r)))
        me = int(key[len(ASSIGNED_RANKS):])
        role_sizes: dict[str, int] = {}
        for info in infos:
            role_sizes[info["role"]] = role_sizes.get(info["role"], 0) + int(info["local_world_size"])
        base = 0
        role_base: dict[str, int] = {}
        for r, info in enumerate(infos):
            if r == me:
                row = [base, sum(role_sizes.values()), role_base.get(info["role"], 0), role_sizes[info["role"]]]
                return [json.dumps(row).encode()]
            base += int(info["local_world_size"])
            role_base[info["role"]] = role_base.get(info["role"], 0) + int(info["local_world_size"])
        return None


__all__ = ["AssignmentStore"]
