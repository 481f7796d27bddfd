"""The torch glue: ProcessGroupMCCL and its Work, the exchange collectives, the group options,
torch-version compatibility, the world-of-one communicator, shared tensors and DDP buckets.

Named after what it glues to; inside it ``import torch`` still reaches the real torch (absolute
imports). Importing this package imports nothing of torch: ``libmccl`` needs ``options`` without it.
"""
