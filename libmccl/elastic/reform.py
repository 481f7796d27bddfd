"""Re-forming the world in place when a host leaves: the other ranks keep their processes.

Restarting the workers for a re-form costs every host a PyTorch start-up: importing torch,
then DDP's constructor importing torch._dynamo, 9 of the 14 s a 4-host re-form took on the
16-core machine (docs/elastic.md). A host that leaves on purpose (a drain) still takes part in
the step's collectives, so the world can agree in place, over the old group, on who stays and
where the new group meets; then the ranks that stay re-create only what holds the old group,
the default process group and the DDP wrapper (as torchft does), and keep their model,
optimizer, scheduler and data in memory.

``blocker`` says why a job cannot do this (then its workers restart, as before); ``agree`` runs
on every rank of the old world; ``reform`` on the ranks that stay.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from mccl_common.settings import EngineConfig, load

from .. import listen_addr
from . import store_server

_STORE_CONNECT_S = 60.0
# torchrun's per-worker variables that a re-form changes (LOCAL_* stay: a host keeps its ranks).
_RANK_ENV = ("RANK", "ROLE_RANK")
_WORLD_ENV = ("WORLD_SIZE", "ROLE_WORLD_SIZE")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every rank of the old world agreed on: who leaves, and where the new group meets."""

    leaving: tuple[bool, ...]           # by old rank
    hosts: tuple[int, ...]              # torchrun's GROUP_RANK (host index) by old rank
    store_addr: str                     # the new store, served by the new rank 0
    store_port: int

    def new_rank(self, old: int) -> int | None:
        return None if self.leaving[old] else sum(1 for r in range(old) if not self.leaving[r])

    @property
    def new_world(self) -> int:
        return self.leaving.count(False)

    @property
    def hosts_staying(self) -> list[int]:
        return sorted({h for h, gone in zip(self.hosts, self.leaving) if not gone})

    def new_host_index(self, old: int) -> int:
        return self.hosts_staying.index(self.hosts[old])


def blocker(model: torch.nn.Module, optimizer: Any) -> str | None:
    """None when the world can re-form in place; else what in the job holds the old process
    group in a way a re-form cannot rebuild."""
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", None)
    if pg_map is None:
        return "this torch keeps its process groups where libmccl cannot see them"
    others = [pg for pg in pg_map if pg is not default]
    if others:
        return (f"the script created {len(others)} more process group(s) (new_group, DeviceMesh), "
                "which hold the old world")
    if isinstance(model, DDP):
        return _ddp_blocker(model, default)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "the model is sharded (FSDP, DTensor): its shards belong to the old world"
    if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
        return "ZeroRedundancyOptimizer shards its state over the old world"
    return None


def _ddp_blocker(ddp: DDP, default: Any) -> str | None:
    if ddp.process_group is not default:
        return "the DDP model was given its own process group"
    hooks = getattr(ddp, "_comm_hooks", None)
    if hooks is None and getattr(ddp, "_comm_hook_registered", False):
        return "the DDP model has a communication hook this torch does not list, which a rebuilt DDP would not have"
    for hook, state in hooks or ():
        if not getattr(state, "follows_default_group", False):
            return (f"the DDP model has a communication hook ({getattr(hook, '__qualname__', hook)!r}) whose state "
                    "may hold the old group; a rebuilt DDP re-registers only hooks whose state follows the default "
                    "group (libmccl.training.SpeedBalancer's does)")
    if getattr(ddp, "_delay_all_reduce_params", None) or getattr(ddp, "device_mesh", None) is not None:
        return "the DDP model was built with delay_all_reduce_named_params or a device_mesh"
    if len(set(getattr(ddp, "bucket_bytes_cap_list", ()) or ())) > 1:
        return "the DDP model has per-bucket capacities (bucket_cap_mb as a list)"
    if getattr(ddp, "_use_python_reducer", False):
        return "the DDP model uses the Python reducer (compiled autograd)"
    return None


def agree(leaving_here: bool, store_timeout_s: float) -> Plan:
    """Every rank of the old world, at the same step: who leaves, and the new store (served by
    the new rank 0, which must exist: some rank stays)."""
    world = dist.get_world_size()
    me = (bool(leaving_here), int(os.environ.get("GROUP_RANK", "0")))
    seen: list[Any] = [None] * world
    dist.all_gather_object(seen, me)
    leaving = tuple(bool(s[0]) for s in seen)
    hosts = tuple(int(s[1]) for s in seen)
    if all(leaving):
        return Plan(leaving, hosts, "", 0)      # every host leaves: nothing to re-form
    first = leaving.index(False)
    spot: list[Any] = [None, 0]
    if dist.get_rank() == first:
        addr = store_address()
        # On the training address only; the values in it are sealed (rendezvous.exchange).
        store = store_server.serve_store(addr, 0, datetime.timedelta(seconds=store_timeout_s))
        spot = [addr, store.port]
        _SERVED.append(store)
    dist.broadcast_object_list(spot, src=first)
    return Plan(leaving, hosts, str(spot[0]), int(spot[1]))


# The store this process serves for its current group: it must outlive the group (a TCPStore
# server stops when its object is collected), and go once a later re-form replaced it.
_SERVED: list[Any] = []


def store_address() -> str:
    """The address the other hosts reach this one at: the engine's own choice (MCCL_BIND_ADDR,
    MCCL_SOCKET_IFNAME, else the route towards the old group's master)."""
    return listen_addr.choose_bind_address(load(EngineConfig), os.environ.get("MASTER_ADDR"))


def reform(plan: Plan, old_rank: int, backend: str, timeout_s: float) -> None:
    """A rank that stays: joins the new default group (the old one is destroyed already)."""
    rank, world = plan.new_rank(old_rank), plan.new_world
    assert rank is not None, "a leaving rank does not re-form"
    if rank == 0:
        store = _SERVED[-1]
        del _SERVED[:-1]
    else:
        del _SERVED[:]
        # The new rank 0 serves it already (it answered the broadcast): a LAN connect takes
        # milliseconds, so a rank 0 that died since fails this in a minute, not the group's timeout.
        store = dist.TCPStore(plan.store_addr, plan.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=min(timeout_s, _STORE_CONNECT_S)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    # What torchrun told this worker; scripts and libraries that read it see the new world.
    for name in _RANK_ENV:
        if name in os.environ:
            os.environ[name] = str(rank)
    for name in _WORLD_ENV:
        if name in os.environ:
            os.environ[name] = str(world)
    if "GROUP_RANK" in os.environ:
        os.environ["GROUP_RANK"] = str(plan.new_host_index(old_rank))
    if "GROUP_WORLD_SIZE" in os.environ:
        os.environ["GROUP_WORLD_SIZE"] = str(len(plan.hosts_staying))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = plan.store_addr, str(plan.store_port)


def rewrap(ddp: DDP) -> None:
    """Re-creates ``ddp`` on the new default group with the same options, in place: the script
    keeps using its object. The old reducer goes with the old state (its gradient hooks with it).
    Communication hooks that follow the default group (``blocker`` let only those through) are
    registered again and told of the new world (a SpeedBalancer re-plans its shares)."""
    hooks = list(getattr(ddp, "_comm_hooks", None) or ())
    fresh = DDP(ddp.module, **_ddp_options(ddp))
    for hook, state in hooks:
        fresh.register_comm_hook(state, hook)
        state.new_world()
    # One state for both objects: hooks bound to either see the same attributes.
    ddp.__dict__ = fresh.__dict__


def _ddp_options(ddp: DDP) -> dict[str, Any]:
    """The constructor's options, read back from the attributes DDP keeps under the same names
    (the set differs between torch versions; those it cannot keep are refused by blocker)."""
    skip = {"self", "module", "process_group", "device_mesh", "init_sync", "bucket_cap_mb",
            "bucket_cap_mb_list", "delay_all_reduce_named_params", "param_to_hook_all_reduce",
            "check_reduction"}
    params = inspect.signature(DDP.__init__).parameters
    if "forward_sync_buffers" in params:
        skip.add("broadcast_buffers")   # its deprecated spelling, kept as an attribute too
    options = {name: getattr(ddp, name) for name in params if name not in skip and hasattr(ddp, name)}
    options["bucket_cap_mb"] = ddp.bucket_bytes_cap / 2**20
    return options


def group_timeout_s(default_s: float) -> float:
    """The default group's timeout (an mccl group keeps it; other backends get ``default_s``)."""
    value = getattr(dist.distributed_c10d._get_default_group(), "timeout_s", None)
    return float(value) if value else default_s
