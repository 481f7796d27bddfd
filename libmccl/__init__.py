"""MCCL: a torch.distributed backend ("mccl") on a C++ ring engine over TCP."""
