"""The client of mccld (``MCCL_DAEMON=1``): ``client.DaemonCommunicator`` attaches to the host's
daemon (``attach``), builds ops (``ops``), waits on gates (``gates``), maps the shared buffers
(``buffers``) and posts point-to-point receives (``p2p``).
"""
