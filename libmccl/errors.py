"""The typed errors a training script catches (``from libmccl.errors import PeerLostError``).

They are declared once, in ``mccl_common.errors``, which mccld and mcclctl raise too;
this module is their name under the package users install.
"""

from mccl_common.errors import (AbortedError, AuthError, CollectiveMismatch, CollectiveTimeout,  # noqa: F401
                                ConfigError, DaemonUnavailableError, MCCLError, PeerLostError, ProtocolError,
                                StoreAuthError, from_kind)
from mccl_common.errors import __all__  # noqa: F401
