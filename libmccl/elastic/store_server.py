"""A TCPStore server that listens on one address (the training interface) only.

torch's TCPStore server listens on every interface whatever host name it is given, which
puts the job's stores on the office network too. Its ``master_listen_fd`` takes a socket we
bound ourselves (the libuv server supports it); the store owns that socket from then on.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Any

_log = logging.getLogger(__name__)


def bound_socket(addr: str, port: int) -> socket.socket:
    """A listening socket on ``addr:port`` (port 0: any free one); raises OSError."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def serve_store(addr: str, port: int, timeout: datetime.timedelta, multi_tenant: bool = False) -> Any:
    """A TCPStore server on ``addr:port`` only; ``store.port`` is the port it got. Raises
    OSError when ``addr`` is not this host's or the port is taken, RuntimeError from torch."""
    from torch.distributed import TCPStore

    sock = bound_socket(addr, port)
    bound_port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return TCPStore(addr, bound_port, is_master=True, wait_for_workers=False, timeout=timeout,
                        multi_tenant=multi_tenant, master_listen_fd=fd, use_libuv=True)
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass    # torch took it and closed it already
        raise


__all__ = ["bound_socket", "serve_store"]
