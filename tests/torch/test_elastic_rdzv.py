"""torchrun's `--rdzv-backend mccl` handler (libmccl/elastic/rdzv.py) in one process: options,
the anchor, the state backend, and rounds between handlers that stand for hosts (threads
here; separate torchruns in tests/e2e/test_torchrun_rdzv.py)."""

from __future__ import annotations

import datetime
import gc
import logging
import os
import socket
import threading
import time
from importlib.metadata import entry_points

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousClosedError, RendezvousConnectionError,
                                                  RendezvousParameters, RendezvousStateError,
                                                  RendezvousTimeoutError)
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

from libmccl.elastic import rdzv as er
from mccl_common.errors import AbortedError, CollectiveTimeout, ConfigError, PeerLostError
from mccl_common.launch_protocol import AWARE_SUFFIX
from mccl_common.settings import RendezvousConfig, load
from support.ports import free_port as _free_port
from support.rdzv import in_threads

pytestmark = pytest.mark.timeout(60)


def _params(endpoint: str = "", min_nodes: int = 1, max_nodes: int = 1, run_id: str = "r",
            **conf) -> RendezvousParameters:
    return RendezvousParameters("mccl", endpoint, run_id, min_nodes, max_nodes, **conf)


def test_torchrun_finds_the_backend_through_its_entry_point_group() -> None:
    names = [ep.name for ep in entry_points(group="torchrun.handlers")]
    assert "mccl" in names, names
    assert "mccl" in registry._registry  # torch registered it when it imported the rendezvous package


def test_options_come_from_the_settings_with_rdzv_conf_keys_on_top(caplog) -> None:
    cfg = load(RendezvousConfig, env={"MCCL_RDZV_JOIN_TIMEOUT": "7", "MCCL_RDZV_HEARTBEAT": "0.5"})
    # torchrun always passes timeout=900 (the legacy etcd key): ignored, silently.
    opts = er.RunOptions.parse(_params(timeout=900, last_call_timeout="3", keep_alive_max_attempt="4"), cfg)
    assert (opts.join_timeout_s, opts.heartbeat_s, opts.last_call_s, opts.heartbeat_misses) == (7, 0.5, 3, 4)
    assert (opts.store_timeout_s, opts.close_timeout_s, opts.is_host) == (10, 3, None)
    assert "ignoring" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="libmccl.elastic.rdzv"):
        assert er.RunOptions.parse(_params(store_type="file", is_host="1"), cfg).is_host is True
    assert "ignoring --rdzv-conf store_type" in caplog.text
    with pytest.raises(ConfigError, match="join_timeout='soon' is not a number"):
        er.RunOptions.parse(_params(join_timeout="soon"), cfg)
    with pytest.raises(ConfigError, match="read_timeout='0' must be positive"):
        er.RunOptions.parse(_params(read_timeout="0"), cfg)
    with pytest.raises(ConfigError, match=r"keep-alive window 0.5s x 2 = 1s is under 2s"):
        er.RunOptions.parse(_params(keep_alive_interval="0.5", keep_alive_max_attempt="2"), cfg)
    with pytest.raises(ConfigError, match="is_host='maybe'"):
        er.RunOptions.parse(_params(is_host="maybe"), cfg)
    with pytest.raises(ConfigError, match="MCCL_RDZV_HEARTBEAT_MISSES"):
        load(RendezvousConfig, env={"MCCL_RDZV_HEARTBEAT_MISSES": "0"})


def test_the_anchor_is_the_endpoint_else_the_setting() -> None:
    cfg = RendezvousConfig(anchor="anchor.lan")
    assert er.anchor_endpoint("10.0.0.5:1234", cfg) == ("10.0.0.5", 1234)
    assert er.anchor_endpoint("", cfg) == ("anchor.lan", er.DEFAULT_PORT)
    with pytest.raises(ConfigError, match="no anchor: .*--rdzv-endpoint HOST"):
        er.anchor_endpoint("", RendezvousConfig())
    with pytest.raises(ConfigError, match="port 0"):
        er.anchor_endpoint("10.0.0.5:0", cfg)


def test_errors_are_torchs_rendezvous_errors_and_ours() -> None:
    assert issubclass(er.RendezvousUnreachable, RendezvousConnectionError)
    assert issubclass(er.RendezvousUnreachable, PeerLostError)
    assert issubclass(er.RendezvousJoinTimeout, RendezvousTimeoutError)
    assert issubclass(er.RendezvousJoinTimeout, CollectiveTimeout)
    assert issubclass(er.RendezvousClosed, RendezvousClosedError)
    assert issubclass(er.RendezvousClosed, AbortedError)
    assert er.RendezvousUnreachable("m", peer_addr="h:1").peer_addr == "h:1"


def test_the_backend_keeps_one_compare_and_set_state() -> None:
    store = dist.HashStore()
    b = er.AnchorStoreBackend(store, "run", "anchor:1")
    assert b.name == "mccl" and b.get_state() is None
    state, token, ok = b.set_state(b"first")
    assert (state, ok) == (b"first", True)
    assert b.get_state() == (b"first", token)
    # A second host writing over a state it did not read loses, and learns the current one
    # once a host of the run (b, reading in the background) has vouched for it.
    other = er.AnchorStoreBackend(store, "run", "anchor:1")  # joining does not reset the state
    stop = threading.Event()
    reader = threading.Thread(target=lambda: [b.get_state() for _ in iter(lambda: stop.wait(0.05), True)])
    reader.start()
    try:
        got = other.set_state(b"stale")
    finally:
        stop.set()
        reader.join(10)
    token = b.get_state()[1]     # b's acknowledgement wrote the state anew
    assert got == (b"first", token, False)
    state2, token2, ok2 = other.set_state(b"second", token)
    assert (state2, ok2) == (b"second", True) and token2 != token
    assert er.AnchorStoreBackend(store, "another-run", "anchor:1").get_state() is None
    store.set("mccl/rdzv/run/state", "%%% not base64")
    with pytest.raises(RendezvousStateError,
                       match=r"mccl/rdzv/run/state.*not a sealed MCCL value, peer=anchor:1.*--rdzv-id"):
        b.get_state()


def test_a_store_failure_names_the_anchor() -> None:
    class Broken:
        def compare_set(self, *a):
            return b"mccl-rdzv-empty"

        def get(self, key):
            raise RuntimeError("Broken pipe")

    with pytest.raises(er.RendezvousUnreachable, match=r"lost the anchor's rendezvous store, peer=h:29400 "
                                                         r"\(RuntimeError: Broken pipe\)") as info:
        er.AnchorStoreBackend(Broken(), "r", "h:29400").get_state()
    assert info.value.peer_addr == "h:29400"


def test_an_anchor_nobody_serves_fails_within_the_store_timeout() -> None:
    port = _free_port()
    started = time.monotonic()
    with pytest.raises(er.RendezvousUnreachable, match=rf"cannot reach the anchor's rendezvous store, "
                                                       rf"peer=127.0.0.1:{port}, within 1s .*start it first"):
        er.open_anchor_store("127.0.0.1", port, serve=False, timeout_s=1.0)
    assert time.monotonic() - started < 3


def test_a_busy_anchor_port_is_joined_unless_told_to_serve() -> None:
    port = _free_port()
    server, serving = er.open_anchor_store("127.0.0.1", port, serve=None, timeout_s=5)
    assert serving
    client, serving2 = er.open_anchor_store("127.0.0.1", port, serve=None, timeout_s=5)
    assert not serving2
    client.set("k", "v")
    assert server.get("k") == b"v"
    with socket.socket() as other:  # another program holds a port
        other.bind(("0.0.0.0", 0))
        other.listen()
        held = other.getsockname()[1]
        with pytest.raises(er.RendezvousUnreachable, match=rf"cannot serve the rendezvous store on port {held}"):
            er.open_anchor_store("127.0.0.1", held, serve=True, timeout_s=5)
    del client, server
    gc.collect()


def test_two_hosts_form_a_round_with_the_anchor_address(rdzv_handlers) -> None:
    port = _free_port()
    a = rdzv_handlers(port, 2, 2, is_host="1")
    b = rdzv_handlers(port, 2, 2, is_host="0")
    assert a.serves_anchor and not b.serves_anchor and a.get_backend() == "mccl"
    started = time.monotonic()
    infos = in_threads(a.next_rendezvous, b.next_rendezvous)
    took = time.monotonic() - started
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}, infos
    # The address rank 0 advertises is on the route to the anchor (here loopback); it is the
    # workers' MASTER_ADDR.
    assert {i.bootstrap_store_info.master_addr for i in infos} == {"127.0.0.1"}
    assert took < 5, f"{took:.1f}s"


def test_too_few_hosts_time_out_naming_the_anchor(rdzv_handlers) -> None:
    port = _free_port()
    a = rdzv_handlers(port, 2, 2, join_timeout="1")
    started = time.monotonic()
    with pytest.raises(er.RendezvousJoinTimeout, match=rf"run 'r': fewer than 2 hosts joined within 1s \(this one "
                                                       rf"and 0 others\), peer=127.0.0.1:{port} \(the anchor\)"):
        a.next_rendezvous()
    assert time.monotonic() - started < 5


def test_a_closed_run_says_so(rdzv_handlers) -> None:
    port = _free_port()
    a = rdzv_handlers(port, 1, 2)
    b = rdzv_handlers(port, 1, 2)
    a.set_closed()  # what a torchrun does when it finishes or gives up
    with pytest.raises(er.RendezvousClosed, match=rf"run 'r' is closed, peer=127.0.0.1:{port}.*new --rdzv-id"):
        b.next_rendezvous()


def test_a_host_still_waiting_when_the_run_ends_exits_0(rdzv_handlers, caplog) -> None:
    """mcclctl run recruits an idle host during a run's last steps: its torchrun waits for the
    next round, and the run finishes and closes first. Nothing failed there: it exits 0 (torchrun
    ends cleanly on SystemExit(0)), not with RendezvousClosed, which made mcclctl report a job
    that ran every step as failed. A run closed before the host came still says so (above)."""
    port = _free_port()
    a = rdzv_handlers(port, 1, 2, is_host="1")
    a.reform_file = ""          # the waiting host is reported as is, no workers to ask
    assert a.next_rendezvous().world_size == 1
    b = rdzv_handlers(port, 1, 2)
    out: list = []

    def join():
        try:
            out.append(b.next_rendezvous())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    t = threading.Thread(target=join)
    t.start()
    deadline = time.monotonic() + 10
    while a.num_nodes_waiting() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.num_nodes_waiting() == 1, "the late host never reached the wait list"
    with caplog.at_level(logging.WARNING, logger="libmccl.elastic.rdzv"):
        a.set_closed()          # the run's last host finished
        t.join(15)
    assert not t.is_alive()
    assert len(out) == 1 and isinstance(out[0], SystemExit) and out[0].code == 0, out
    assert "ended before this host was taken in" in caplog.text


def test_a_silent_host_is_dropped_and_the_next_round_forms_without_it(rdzv_handlers) -> None:
    """The elastic case: min 1, max 2; a host that stops its keep-alives (dead, as far as the
    store can tell) no longer counts, and the survivor completes a round alone."""
    port = _free_port()
    # A last call long enough for both threads to make the first round (a host that misses it
    # waits for the next, which only an agent would start).
    fast = {"keep_alive_interval": "0.5", "keep_alive_max_attempt": "4", "last_call_timeout": "2"}
    a = rdzv_handlers(port, 1, 2, is_host="1", **fast)
    b = rdzv_handlers(port, 1, 2, **fast)
    first = in_threads(a.next_rendezvous, b.next_rendezvous)
    assert {i.world_size for i in first} == {2}, first
    b._stop_heartbeats()  # torch's own switch; B now looks dead to the others
    started = time.monotonic()
    again = a.next_rendezvous()
    took = time.monotonic() - started
    assert (again.rank, again.world_size) == (0, 1)
    assert took < 8, f"{took:.1f}s"


def _round_state(handler) -> str:
    """torch's rendezvous state as ``handler`` reads it now: the round, who is in it and waiting,
    and how old each one's last keep-alive is."""
    handler._state_holder.sync()
    st = handler._state_holder.state
    now = datetime.datetime.now(datetime.timezone.utc)
    beats = {str(n): round((now - t).total_seconds(), 1) for n, t in st.last_heartbeats.items()}
    return (f"round {st.round} complete={st.complete} closed={st.closed} participants={sorted(map(str, st.participants))} "
            f"wait_list={sorted(map(str, st.wait_list))} keep-alive ages (s)={beats}")


@pytest.mark.timeout(120)
def test_a_waiting_host_is_taken_in_at_the_workers_next_step_boundary(rdzv_handlers, tmp_path) -> None:
    """torchrun's agent restarts its workers mid-step as soon as num_nodes_waiting() > 0. With
    workers that stop by themselves at a step boundary (libmccl.elastic created the aware
    marker) the handler asks them to (the reform file) and reports 0 until they have, or until
    join_at_step_timeout; for any other script it reports the waiting host at once."""
    port = _free_port()
    # B waits from its join until A's second round. That round did not form within 10 s (the
    # fixture's join timeout) in ci10; it did not within 40 s either in ci13, so the time is
    # not the cause: the failure below says the round's state.
    # What lost it (ci25, ci26: the round B completed was the only one left, with B alone): when A
    # leaves round 0 to re-join, the round resets and B, waiting, joins it first; min_nodes is 1, so
    # a last call of 0.5 s let B complete it alone when A's join came later under load, and A then
    # waited for a round B never asks for. (torchrun heals it: B's agent restarts for the waiting A.)
    # A last call of 5 s lets both in (a round of max_nodes completes at once; A's first round, alone,
    # now waits its 5 s).
    slow = {"join_timeout": "40", "last_call_timeout": "5"}
    a = rdzv_handlers(port, 1, 2, is_host="1", join_at_step_timeout="1", **slow)
    a.reform_file = str(tmp_path / "reform-a")
    assert a.next_rendezvous().world_size == 1
    b = rdzv_handlers(port, 1, 2, **slow)
    joined: list = []
    t = threading.Thread(target=lambda: joined.append(b.next_rendezvous()))
    t.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(a.reform_file) and time.monotonic() < deadline:
        waiting = a.num_nodes_waiting()
        if waiting:
            break
        time.sleep(0.05)
    assert waiting == 1 and not os.path.exists(a.reform_file)    # no aware workers: torchrun restarts them

    open(a.reform_file + AWARE_SUFFIX, "w").close()
    assert a.num_nodes_waiting() == 0 and os.path.exists(a.reform_file)   # asked, not restarted
    time.sleep(1.2)
    assert a.num_nodes_waiting() == 1       # they did not stop in time: torchrun's restart after all
    try:
        again = a.next_rendezvous()         # the workers stopped; the new round takes B in
    except RendezvousTimeoutError as exc:
        # Seen twice, only with the whole suite on four workers beside more load (ci10, ci13),
        # never in the file alone beside three busy loops: say what the round looked like.
        t.join(40)
        b_got = [f"rank {i.rank} of {i.world_size}" for i in joined] or "no round"
        pytest.fail(f"{exc}\nthe run's state as A saw it: {_round_state(a)}\nB (after A gave up): {b_got}")
    t.join(40)
    assert again.world_size == 2 and joined and joined[0].world_size == 2
    assert not os.path.exists(a.reform_file)    # answered: the next workers must not see it


def test_the_join_waits_no_longer_than_a_lan_needs() -> None:
    cfg = RendezvousConfig()
    assert cfg.join_timeout_s <= 120 and cfg.store_timeout_s <= 30
    assert cfg.heartbeat_s * cfg.heartbeat_misses <= 10
    assert datetime.timedelta(seconds=cfg.last_call_s) < datetime.timedelta(seconds=10)


def test_the_anchor_outlives_the_others_shutting_down(rdzv_handlers) -> None:
    """The host serving the store waits for the others of its last round to count themselves
    out before its store may go away, no longer."""
    port = _free_port()
    a = rdzv_handlers(port, 2, 2, is_host="1", close_timeout="3")
    b = rdzv_handlers(port, 2, 2, is_host="0")
    in_threads(a.next_rendezvous, b.next_rendezvous)
    started = time.monotonic()
    took: list[float] = []
    t = threading.Thread(target=lambda: (a.shutdown(), took.append(time.monotonic() - started)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # still waiting for B
    b.shutdown()
    t.join(10)
    assert took and 0.3 <= took[0] < 2, took


@pytest.fixture
def standalone_anchor():
    """`python -m libmccl.elastic.rdzv --port N` in a thread: the store on a host that trains
    nothing. Asked for before rdzv_handlers, it stops after their shutdown."""
    port = _free_port()
    stop = threading.Event()
    server = threading.Thread(target=er.serve_anchor, args=(port, stop, 5.0), name="anchor")
    server.start()
    yield port
    stop.set()
    server.join(10)


def test_a_standalone_anchor_serves_hosts_that_all_dial_it(standalone_anchor, rdzv_handlers) -> None:
    a = rdzv_handlers(standalone_anchor, 2, 2, is_host="0")
    b = rdzv_handlers(standalone_anchor, 2, 2, is_host="0")
    infos = in_threads(a.next_rendezvous, b.next_rendezvous)
    assert sorted(i.rank for i in infos) == [0, 1], infos
    assert not a.serves_anchor and not b.serves_anchor


@pytest.mark.parametrize("aware", [False, True], ids=["plain-script", "elastic-state"])
def test_a_host_of_the_round_going_silent_restarts_plain_workers_at_once(rdzv_handlers, tmp_path, caplog,
                                                                         aware) -> None:
    """torch keeps a complete round going when one of its hosts stops its keep-alives, so plain
    workers waited for it until their own timeout (init_process_group's 60 s, when the host's
    user came back during start-up). The handler reports a waiting node once the host is gone
    from the round, so torchrun restarts them into a round without it; workers that use
    libmccl.elastic re-form in place by themselves and are left alone."""
    port = _free_port()
    fast = {"keep_alive_interval": "0.5", "keep_alive_max_attempt": "4", "last_call_timeout": "2"}
    a = rdzv_handlers(port, 1, 2, is_host="1", **fast)
    b = rdzv_handlers(port, 1, 2, **fast)
    a.reform_file = str(tmp_path / "reform-a")
    if aware:
        open(a.reform_file + AWARE_SUFFIX, "w").close()
    first = in_threads(a.next_rendezvous, b.next_rendezvous)
    assert {i.world_size for i in first} == {2}, first
    assert a.num_nodes_waiting() == 0           # both alive: nothing to do
    b._stop_heartbeats()
    deadline = time.monotonic() + 30
    seen: list[int] = []
    with caplog.at_level(logging.WARNING, logger="libmccl.elastic.rdzv"):
        while len(a._state_field("participants") or ()) == 2:   # until the store drops B
            assert time.monotonic() < deadline, "the silent host never left the round"
            seen.append(a.num_nodes_waiting())  # as torchrun's agent asks, every monitor interval
            time.sleep(0.1)
        seen.append(a.num_nodes_waiting())      # at least once after B was dropped
    if aware:
        assert set(seen) == {0} and "of this round left" not in caplog.text
    else:
        assert seen.count(1) == 1 and "1 host(s) of this round left" in caplog.text
        assert a.num_nodes_waiting() == 0       # said once; the restart's round is the next one


@pytest.mark.parametrize("lost", ["group-rank-1", "group-rank-0"])
def test_a_host_leaving_while_the_agents_assign_ranks_does_not_stop_the_others(rdzv_handlers, caplog, lost) -> None:
    """Right after a round forms, torchrun's agents write their role info and read the rank
    table agent 0 makes, with blocking store reads; a host that left in that moment (its user
    came back) never writes its part, and torch raised DistStoreError at the store's timeout,
    which ends torchrun: the whole job failed (seen in tests/e2e/test_reclaim_fleet.py). The round's
    store answers for a host the rendezvous counts as gone, so the agent that stays gets its
    workers' ranks and the handler then asks for a round without the host."""
    from types import SimpleNamespace
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    port = _free_port()
    # A store read waits 20 s before the change: the agent below would raise DistStoreError.
    fast = {"keep_alive_interval": "0.5", "keep_alive_max_attempt": "4", "last_call_timeout": "2",
            "read_timeout": "20"}
    a = rdzv_handlers(port, 1, 2, is_host="1", **fast)
    b = rdzv_handlers(port, 1, 2, **fast)
    infos = in_threads(a.next_rendezvous, b.next_rendezvous)
    assert {i.world_size for i in infos} == {2}, infos
    by_rank = {info.rank: (h, info) for h, info in zip((a, b), infos)}
    gone_rank = 1 if lost == "group-rank-1" else 0
    stays_handler, stays = by_rank[1 - gone_rank]
    gone_handler, _ = by_rank[gone_rank]
    gone_handler._stop_heartbeats()     # its host left before writing its role info
    spec = SimpleNamespace(role="default", local_world_size=2)
    agent = SimpleNamespace()           # _assign_worker_ranks does not use its agent's state
    with caplog.at_level(logging.WARNING, logger="libmccl.elastic.rdzv"):
        workers = SimpleElasticAgent._assign_worker_ranks(agent, stays.store, stays.rank, 2, spec)
    assert [w.world_size for w in workers] == [4, 4]
    assert [w.global_rank for w in workers] == ([0, 1] if stays.rank == 0 else [2, 3])
    assert f"group rank [{gone_rank}] left while torchrun's agents assigned" in caplog.text
    # The workers start one host short; the agent's next look restarts them without it.
    assert stays_handler.num_nodes_waiting() == 1
