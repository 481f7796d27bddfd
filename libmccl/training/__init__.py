"""Training algorithms written over torch.distributed collectives (no engine internals):
``DiLoCo`` (public: ``libmccl.DiLoCo``), which synchronizes every H inner steps with an outer
optimizer, optionally streaming fragments of the model with a delay and compressed outer
gradients. They run on any process group: mccl in-process, mccl through mccld, gloo.
"""

from .diloco import DiLoCo  # noqa: F401 - the public name

__all__ = ["DiLoCo"]
