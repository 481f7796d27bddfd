"""Training helpers on top of torch.distributed: speed-aware batch shares (balance.py)."""

from .balance import SpeedBalancer
from .shares import SharePlanner, plan_shares

__all__ = ["SharePlanner", "SpeedBalancer", "plan_shares"]
