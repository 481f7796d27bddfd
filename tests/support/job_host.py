"""A stand-in for the daemon behind mccld's ``Job`` (the ``JobHost`` seam of mccld/jobs/job.py):
it records the peers' notices and does nothing else, so a unit test can drive a Job's
requests and its thread in a chosen order without links, engines or an attach socket."""

from __future__ import annotations

from mccl_common.errors import MCCLError


class StandInHost:
    host_id = "h0"
    pool = None
    engine_cfg = None

    def __init__(self) -> None:
        self.notified: list[MCCLError] = []
        self.handed: dict[str, int] = {}   # segment name -> the descriptor its client handed over

    def take_segment(self, ident, name) -> int:
        from mccl_common.errors import ProtocolError
        if name not in self.handed:
            raise ProtocolError(f"[daemon] segment {name} was not handed over")
        return self.handed.pop(name)

    def reply(self, ident, req, payload) -> None: ...
    def reply_error(self, ident, req, exc) -> None: ...
    def build_engine(self, job): raise AssertionError("no engine in this test")
    def release_data_sockets(self, job, clean) -> None: ...
    def notify_peers_failed(self, job, exc) -> None: self.notified.append(exc)
    def record_collective(self, job, op, nbytes, seconds) -> None: ...
    def record_reduced(self, job, nbytes, encoded) -> None: ...
    def poll_traffic(self, job) -> None: ...
    def job_closed(self, job) -> None: ...
