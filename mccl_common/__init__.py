"""What every MCCL component shares, and nothing else: the bottom of the package graph.

``libmccl`` (the torch backend and the daemon client), ``mccld`` and ``mcclctl`` import
this package and the engine (``libmccl._core``, C++, which knows bytes, dtypes and reduce
ops); none of them imports another's modules, and this package imports none of ours
(tests/project/test_layers.py checks both). What is here:

- ``errors``: the typed errors, and their codes on the wire;
- ``settings`` (the registry and the engine's ``MCCL_*`` settings) and ``daemon_settings``;
- ``wire``: the dtype and reduce-op codes and sizes, checked against the engine's;
- ``attach_protocol`` and ``shm``: the client <-> mccld messages and shared-memory layout;
- ``status_protocol``: mccld's status/control endpoint, as mcclctl speaks it;
- ``netif``: which local address faces the fleet.
"""

__version__ = "0.1.0"

# Bumped whenever the client<->daemon or daemon<->daemon wire format changes.
PROTO_VERSION = 2          # 2: daemon-to-daemon link frames AES-256-GCM (mccld/net/auth.py)
