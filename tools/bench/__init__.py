"""mccl-bench: an nccl-tests style sweep of MCCL against Gloo and the network's own ceiling.

One invocation measures, on the same hosts and in the same run: the ring ceiling (iperf3,
every host sending to its right neighbour at once), then each series' collectives over a
range of sizes (mccl in-process, mccl through one mccld per host, Gloo), with algbw/busbw,
latency and CPU seconds per wire GB, or DDP training steps (``--workload ddp``). Ranks are
separate processes, on loopback or on the hosts of an emulated fleet (tools.fleet).

The harness imports torch only inside the rank processes (worker.py), and never zmq or
zeroconf: it runs on machines that have only torch and the built engine. Only the daemon
series needs mccld's dependencies, in the mccld processes it starts (daemons.py).
``python -m tools.bench scale`` (scale.py) goes to 256 emulated hosts with ranks that
import no torch at all (engine_rank.py), time-dilated, beside the alpha-beta model (model.py).
"""
