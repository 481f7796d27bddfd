"""One torchft replica for tests/torch/test_torchft.py: ``python torchft_replica.py '<json plan>'``.

torchft's own DiLoCo (or LocalSGD) trains a small model on this replica's data under a torchft
Manager whose process group is mccl's (libmccl.torchft_process_group) or torchft's Gloo one, and
writes the final parameters (and what ran) to ``plan["out"]`` as JSON.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
import torch.distributed as dist
from torchft import Manager
from torchft.local_sgd import DiLoCo, LocalSGD
from torchft.process_group import ProcessGroupGloo

import libmccl


def build_model() -> torch.nn.Module:
    """The same weights on every replica (and in the test's reference)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def replica_data(rid: int, batches: int) -> list:
    """Each replica its own batches."""
    gen = torch.Generator().manual_seed(100 + rid)
    return [(torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(batches)]


def main() -> int:
    plan = json.loads(sys.argv[1])
    rid = plan["replica"]
    model = build_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    data = replica_data(rid, plan["rounds"] * plan["sync_every"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = datetime.timedelta(seconds=plan["timeout_s"])
    pg = libmccl.torchft_process_group(timeout) if plan["backend"] == "mccl" else ProcessGroupGloo(timeout)
    manager = Manager(pg=pg, min_replica_size=2, load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, replica_id=f"replica{rid}",
                      store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=plan["lighthouse"], hostname="127.0.0.1", timeout=timeout,
                      quorum_timeout=timeout, connect_timeout=timeout,
                      use_async_quorum=plan["algorithm"] != "diloco",
                      # Every replica starts from the same seed. With init_sync the first quorum (at
                      # the first sync) would load replica 0's state, its local steps included, into
                      # the others, and the first round would count one replica's data only.
                      init_sync=False)   # torchft's DiLoCo requires a synchronous quorum
    used = None
    try:
        if plan["algorithm"] == "diloco":
            wrapper = DiLoCo(manager, [model], inner, outer, sync_every=plan["sync_every"])
        else:
            wrapper = LocalSGD(manager, model, inner, sync_every=plan["sync_every"])
        with wrapper:
            for x, y in data:
                inner.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                inner.step()
                if used is None and getattr(pg, "_pg", None) is not None:
                    used = type(pg._pg).__name__   # the communicator torchft built for this quorum
        result = {"params": [p.detach().flatten().tolist() for p in model.parameters()],
                  "step": manager.current_step(), "pg": pg.getBackendName(), "inner_pg": used,
                  "via_daemon": "libmccl.daemon.client" in sys.modules}
    finally:
        manager.shutdown(wait=False)
    with open(plan["out"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
