"""mccld: the per-host MCCL daemon.

It discovers the other daemons of its fleet over mDNS, keeps authenticated links to
them, and serves local training processes (``MCCL_DAEMON=1``) over ZeroMQ and shared
memory: their collectives are reduced on this host first, then across hosts.
"""

__version__ = "0.1.0"

# Bumped whenever the client<->daemon or daemon<->daemon wire format changes.
PROTO_VERSION = 1
