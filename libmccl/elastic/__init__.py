"""Elastic jobs: ``ElasticState`` (public: ``from libmccl.elastic import ElasticState``), torchrun's
``--rdzv-backend mccl`` handler (``rdzv``), the in-place re-form (``reform``) and the one-address
store server they start.
"""

from .state import ElasticState  # noqa: F401 - the public name

__all__ = ["ElasticState"]
