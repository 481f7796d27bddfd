"""Elastic training on harvested hosts: checkpoint at a step boundary, leave, re-form, resume.

A training script under ``mcclctl run`` (or ``torchrun --rdzv-backend mccl``) wraps its loop::

    from libmccl.elastic import ElasticState
    state = ElasticState("/shared/ckpt/run1", model=model, optimizer=opt, scheduler=sched, every=100,
                         keep_workers=True)
    for step in range(state.resume(), total_steps):     # 0 on a fresh run
        ...one step, with the global batch split over dist.get_world_size() ranks...
        if state.step_done(step):                       # re-formed in place: a host left
            ...read dist.get_rank() and dist.get_world_size() again...

``step_done`` agrees with every rank, at the same step, whether a host must leave: its mccld
drains it when its user comes back (it creates the job's MCCL_DRAIN_FILE). Then every rank
saves the state after this step (torch.distributed.checkpoint, into ``directory``, which every
host must reach: a shared folder), the leaving host's ranks exit 0 and the others exit with
REFORM_EXIT so that torchrun restarts them into a world without the leaving host; ``resume``
then loads that step and returns the next, so no step is lost or repeated. Every ``every``
steps it also saves, so a host that dies (kill -9, cable pulled) costs at most that many
steps: the others fail with PeerLostError, torchrun re-forms, and they resume from there.
With ``keep_workers=True`` a leave costs no restart: the ranks that stay re-form in place
(libmccl/elastic/reform.py: a new default group and the DDP wrapper rebuilt, the rest kept in
memory) and ``step_done`` returns True. It is opt-in because the script must read its rank and
world size again then; a job whose other process groups or sharded model hold the old world
(new_group, DeviceMesh, FSDP, a DDP comm hook) restarts its workers as without it.
A host that asks to join (it turned idle, up to ``--nnodes`` MAX) is always taken in by a restart
(its workers start in torchrun's next round): the
rendezvous handler in torchrun creates MCCL_REFORM_FILE, every rank saves after the step in
which any rank saw it and exits with REFORM_EXIT, and the larger world resumes from that step.

Saved: the model and optimizer (DCP), the scheduler, the step, ``extra`` (the data position,
or anything small the script keeps there) and every rank's RNG states (Python, NumPy if
present, torch CPU, and the accelerator's). A script that never calls this still runs; on a
change of hosts torchrun restarts it from step 0, which ``mcclctl run`` says.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torch.distributed.constants import default_pg_timeout

from mccl_common.errors import ConfigError
from mccl_common.launch_protocol import AWARE_SUFFIX, DRAIN_ENV, LEFT_SUFFIX, REFORM_ENV

from . import reform

log = logging.getLogger(__name__)

REFORM_EXIT = 75                # EX_TEMPFAIL: torchrun restarts the workers, the world re-forms
KEEP = 2                        # checkpoints kept; older ones are removed once a newer one is complete
_DONE = "COMPLETE"


class ElasticState:
    """What a training script hands over to survive hosts leaving: see the module docstring."""

    def __init__(self, directory: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                 every: int = 100, extra: dict | None = None, keep_workers: bool = False,
                 replicated: dict[str, Any] | None = None):
        if every < 1:
            raise ConfigError(f"[elastic] every={every}: checkpoint at least every step (every >= 1)")
        if not dist.is_initialized():
            raise ConfigError("[elastic] call dist.init_process_group first: the state is saved by every rank")
        self.directory = Path(directory)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.every = every
        self.extra: dict = dict(extra or {})
        self.keep_workers = keep_workers
        # Objects with state_dict()/load_state_dict() whose state is the same on every rank (a
        # DiLoCo's theta_global and outer optimizer): rank 0 saves them, every rank loads them.
        self.replicated: dict[str, Any] = dict(replicated or {})
        self._rngs: list = []           # every rank's RNG states at the last save
        self._drain_file = os.environ.get(DRAIN_ENV, "")
        self._reform_file = os.environ.get(REFORM_ENV, "")
        self.resumed_from: int | None = None     # the step the last resume() loaded, None: fresh start
        if self._reform_file and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            try:
                Path(self._reform_file + AWARE_SUFFIX).touch()
            except OSError as exc:      # the handler then restarts the workers for a joining host
                log.warning("[elastic] cannot create %s (%s): a joining host costs the steps since the last save",
                            self._reform_file + AWARE_SUFFIX, exc)

    # ---- resume ----------------------------------------------------------------------

    def resume(self) -> int:
        """Loads the newest complete checkpoint, if any; returns the first step to run."""
        latest = self._latest()
        if latest is None:
            self.resumed_from = None
            return 0
        step, path = latest
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        sd = self._tensors()
        dcp.load(sd, checkpoint_id=str(path / "dcp"))
        set_state_dict(self.model, [self.optimizer] if self.optimizer else [],
                       model_state_dict=sd["model"], optim_state_dict=sd.get("optim", {}))
        with open(path / "meta.pkl", "rb") as fh:
            meta = pickle.load(fh)
        if self.scheduler is not None and meta.get("scheduler") is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        self.extra = meta.get("extra", {})
        if self.replicated:
            saved = torch.load(path / "replicated.pt", map_location="cpu", weights_only=True)
            for name, obj in self.replicated.items():
                obj.load_state_dict(saved[name])
        rngs = meta.get("rng", [])
        if rngs:
            # A smaller world takes the states of its ranks; a larger one reuses them round robin,
            # so each rank's stream continues rather than restarting from the seed.
            _set_rng(rngs[dist.get_rank() % len(rngs)])
        self.resumed_from = step
        if dist.get_rank() == 0:
            log.warning("[elastic] resumed after step %d from %s with %d ranks (saved by %d)", step, path,
                        dist.get_world_size(), meta.get("world", 0))
        return step + 1

    # ---- each step -------------------------------------------------------------------

    def step_done(self, step: int) -> bool:
        """Call after every step. Saves when due; when a host must leave or one joins, saves and
        exits this process (0 on the leaving host, REFORM_EXIT elsewhere) so that torchrun re-forms.
        With ``keep_workers`` the ranks that stay when a host leaves re-form in place instead and
        this returns True: the world changed, so read dist.get_rank() and get_world_size() again."""
        mine = 1 if self._drain_file and os.path.exists(self._drain_file) else 0
        joining = 1 if self._reform_file and os.path.exists(self._reform_file) else 0
        # One all-reduce, every rank the same answer: the hosts re-form after the same step.
        flags = torch.tensor([mine, joining], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        leaving, reforming = bool(flags[0].item()), bool(flags[1].item())
        if leaving or reforming or (step + 1) % self.every == 0:
            self.save(step)
        if not (leaving or reforming):
            return False
        rank = dist.get_rank()
        # Every rank must take the same way (agree() is collective): in place only if all can.
        blocked = torch.tensor([0 if self._in_place_blocker(joining=reforming) is None else 1], dtype=torch.int32)
        dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
        in_place, plan = not bool(blocked.item()), None
        if in_place:
            # The group's timeout (torch's default where its backend does not keep one) bounds
            # the new store and the new group alike.
            timeout_s = reform.group_timeout_s(default_pg_timeout.total_seconds())
            plan = reform.agree(bool(mine), timeout_s)
            in_place = plan.new_world > 0
        if mine:
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:
                Path(self._drain_file + LEFT_SUFFIX).write_text(str(step))
            print(f"[elastic] rank {rank}: this host leaves after step {step} (its user is back); "
                  "the others re-form and resume from here", flush=True)
            dist.destroy_process_group()
            sys.exit(0)
        why = "a host leaves" if leaving else "a host joins"
        if not in_place:
            print(f"[elastic] rank {rank}: {why} after step {step}; re-forming", flush=True)
            dist.destroy_process_group()
            sys.exit(REFORM_EXIT)
        print(f"[elastic] rank {rank}: {why} after step {step}; re-forming in place", flush=True)
        self._reform_in_place(plan, step, timeout_s)
        return True

    def _in_place_blocker(self, joining: bool) -> str | None:
        """Why this re-form restarts the workers; None when the ranks that stay keep their processes."""
        if not self.keep_workers:
            return "keep_workers is off"
        if joining:
            return "a joining host's workers start in torchrun's next round"   # restart for everyone
        why = reform.blocker(self.model, self.optimizer)
        if why is not None and dist.get_rank() == 0:
            log.warning("[elastic] re-forming by restarting the workers: %s", why)
        return why

    def _reform_in_place(self, plan: "reform.Plan", step: int, timeout_s: float) -> None:
        old_rank, backend = dist.get_rank(), dist.get_backend()
        started = time.monotonic()
        dist.destroy_process_group()
        reform.reform(plan, old_rank, backend, timeout_s)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            reform.rewrap(self.model)
        # As resume() after a restart: rank r continues old rank r's random streams, so a job
        # follows the same numbers whichever way it re-formed.
        if self._rngs:
            _set_rng(self._rngs[dist.get_rank() % len(self._rngs)])
        self.resumed_from = step
        if dist.get_rank() == 0:
            log.warning("[elastic] re-formed in place after step %d with %d ranks (was %d) in %.2fs",
                        step, dist.get_world_size(), len(plan.leaving), time.monotonic() - started)

    def save(self, step: int) -> Path:
        """Every rank writes its part of the state after ``step``; rank 0 marks it complete last."""
        import torch.distributed.checkpoint as dcp
        path = self.directory / f"step-{step:09d}"
        rank = dist.get_rank()
        dcp.save(self._tensors(), checkpoint_id=str(path / "dcp"))
        if self.replicated and rank == 0:
            tmp = path / "replicated.pt.tmp"
            torch.save({name: obj.state_dict() for name, obj in self.replicated.items()}, tmp)
            tmp.replace(path / "replicated.pt")
        rngs: list = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, _get_rng())
        self._rngs = rngs
        if rank == 0:
            meta = {"step": step, "world": dist.get_world_size(), "extra": self.extra, "rng": rngs,
                    "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
            tmp = path / "meta.pkl.tmp"
            with open(tmp, "wb") as fh:
                pickle.dump(meta, fh)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(path / "meta.pkl")
        dist.barrier()      # every rank's files are written before the marker says so
        if rank == 0:
            (path / _DONE).write_text(str(step))
            self._prune(keep=path)
        return path

    # ---- helpers ---------------------------------------------------------------------

    def _tensors(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, [self.optimizer] if self.optimizer else [])
        sd = {"model": model_sd}
        if self.optimizer is not None:
            sd["optim"] = optim_sd
        return sd

    def _latest(self) -> tuple[int, Path] | None:
        found = []
        if self.directory.is_dir():
            for p in self.directory.glob("step-*"):
                try:
                    found.append((int(p.name[5:]), p))
                except ValueError:
                    continue
        found = [(s, p) for s, p in found if (p / _DONE).exists()]
        return max(found) if found else None

    def _prune(self, keep: Path) -> None:
        done = sorted((p for p in self.directory.glob("step-*") if (p / _DONE).exists()), key=lambda p: p.name)
        for old in done[:-KEEP]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


def _get_rng() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    # Only a job that uses CUDA: asking an untouched CUDA for its state would open a context
    # (hundreds of MB and seconds) in every rank of a CPU job on a machine with a GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        state["mps"] = mps.get_rng_state()
    return state


def _set_rng(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


__all__ = ["AWARE_SUFFIX", "DRAIN_ENV", "REFORM_ENV", "REFORM_EXIT", "ElasticState"]
