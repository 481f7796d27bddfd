"""mccl-bench: an nccl-tests style sweep of MCCL against Gloo and the network's own ceiling.

One invocation measures, on the same hosts and in the same run: the ring ceiling (iperf3,
every host sending to its right neighbour at once), then each backend's collectives over a
range of sizes, with algbw/busbw, latency and CPU seconds per wire GB. Ranks are separate
processes, either on loopback or one per host of an emulated fleet (libmccl.fleet).

This package imports torch only inside the rank processes (worker.py), and never zmq or
zeroconf, so it runs on machines that have only torch and the built engine.
"""
