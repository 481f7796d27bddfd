"""The job key every test's ranks share (mccl_common/jobkey.py), written once per test process."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from mccl_common.daemon_settings import write_key_file


def install_session_job_key() -> str:
    """Write a fresh key file (mode 0600) and point MCCL_JOB_KEY_FILE at it, unless the
    environment already names one (a child of a test process inherits its parent's)."""
    if os.environ.get("MCCL_JOB_KEY_FILE"):
        return os.environ["MCCL_JOB_KEY_FILE"]
    root = tempfile.mkdtemp(prefix="mccl-test-key-")
    path = str(write_key_file(os.path.join(root, "job.key")))
    pid = os.getpid()
    atexit.register(lambda: os.getpid() == pid and shutil.rmtree(root, ignore_errors=True))
    os.environ["MCCL_JOB_KEY_FILE"] = path
    return path
