"""OnceLogger: a repeated network error is logged at WARNING once, then at DEBUG, and the
keys it remembers are capped (a hostile peer mints a new key with every connection)."""

from __future__ import annotations

import logging
import time

from mccld.logutil import OnceLogger


def test_warns_once_per_key_then_logs_at_debug(caplog):
    log = logging.getLogger("test.once")
    caplog.set_level(logging.DEBUG, logger="test.once")
    once = OnceLogger(log)
    for _ in range(3):
        once.warn("peer:a", "lost %s", "a")
    once.warn("peer:b", "lost %s", "b")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "lost a"), ("DEBUG", "lost a"), ("DEBUG", "lost a"), ("WARNING", "lost b")]
    once.forget("peer:a")
    once.warn("peer:a", "lost %s", "a")
    assert caplog.records[-1].levelname == "WARNING"


def test_the_keys_it_remembers_are_capped_oldest_out_first(caplog):
    log = logging.getLogger("test.once.cap")
    caplog.set_level(logging.DEBUG, logger="test.once.cap")
    once = OnceLogger(log, max_keys=100)
    for i in range(10_000):
        once.warn(f"client:{i}", "bad request from %d", i)
    assert len(once) == 100
    once.warn("client:9999", "again")           # still remembered: DEBUG
    assert caplog.records[-1].levelname == "DEBUG"
    once.warn("client:0", "again")              # long forgotten: WARNING again
    assert caplog.records[-1].levelname == "WARNING"


def test_with_rewarn_a_recurring_refusal_warns_again_once_per_interval(caplog):
    """Refusals of one peer (issue 24): logged at WARNING once per peer per interval (a minute
    in mccld), DEBUG in between, so a refusal that goes on stays visible but cannot flood."""
    log = logging.getLogger("test.once.rewarn")
    caplog.set_level(logging.DEBUG, logger="test.once.rewarn")
    once = OnceLogger(log, rewarn_s=0.3)
    for _ in range(20):
        once.warn("peer:a", "refused %s", "a")
    time.sleep(0.35)
    for _ in range(5):
        once.warn("peer:a", "refused %s", "a")
    levels = [r.levelname for r in caplog.records]
    assert levels == ["WARNING"] + ["DEBUG"] * 19 + ["WARNING"] + ["DEBUG"] * 4


def test_a_traceback_goes_with_the_warning_only(caplog):
    log = logging.getLogger("test.once.exc")
    caplog.set_level(logging.DEBUG, logger="test.once.exc")
    once = OnceLogger(log, rewarn_s=60.0)
    for _ in range(3):
        try:
            raise TypeError("a bug a peer can trigger")
        except TypeError:
            once.warn("bug:10.0.0.9", "unexpected failure serving %s", "10.0.0.9", exc_info=True)
    assert [(r.levelname, bool(r.exc_info)) for r in caplog.records] == [
        ("WARNING", True), ("DEBUG", False), ("DEBUG", False)]
