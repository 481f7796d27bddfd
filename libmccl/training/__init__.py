"""Training algorithms written over torch.distributed collectives (no engine internals), on any
process group (mccl in-process, mccl through mccld, gloo):

- ``DiLoCo`` (public: ``libmccl.DiLoCo``, diloco.py): synchronizes every H inner steps with an
  outer optimizer, optionally streaming fragments of the model with a delay and compressed outer
  gradients;
- ``SpeedBalancer`` (balance.py, over shares.py): speed-aware batch shares for DDP, the gradient
  weighted by samples;
- their Lightning callbacks (lightning_diloco.py, lightning_balance.py; lightning imported only
  when one is made): ``libmccl.lightning_diloco_callback``, ``libmccl.lightning_speed_balancer_callback``.
"""

from .balance import SpeedBalancer
from .diloco import DiLoCo  # noqa: F401 - the public name
from .shares import SharePlanner, plan_shares

__all__ = ["DiLoCo", "SharePlanner", "SpeedBalancer", "plan_shares"]
