"""mccld: the per-host MCCL daemon.

It discovers the other daemons of its fleet over mDNS, keeps authenticated links to
them, and serves local training processes (``MCCL_DAEMON=1``) over ZeroMQ and shared
memory: their collectives are reduced on this host first, then across hosts.
"""

from mccl_common import PROTO_VERSION, __version__  # noqa: F401 - mccld's version is the release's
