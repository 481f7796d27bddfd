"""How ``mcclctl run`` picks hosts (pure: no daemons) and reads its arguments."""

from __future__ import annotations

import pytest

from mccl_common.errors import ConfigError
from mcclctl.__main__ import main
from mcclctl.run import Host, parse_where, select_hosts


def hosts() -> list[Host]:
    return [Host("mac1", "10.0.0.1", 29653, "idle", 24, 64 << 30, "apple-silicon"),
            Host("mac2", "10.0.0.2", 29653, "busy", 24, 64 << 30, "apple-silicon"),
            Host("mac3", "10.0.0.3", 29653, "idle", 12, 32 << 30, "apple-silicon"),
            Host("lnx1", "10.0.0.9", 29653, "idle", 16, 16 << 30, "cpu-x86_64"),
            Host("mac4", "10.0.0.4", 0, "idle", 24, 64 << 30, "apple-silicon")]


def test_idle_hosts_with_most_cores_first_and_the_rest_said_why():
    chosen, left = select_hosts(hosts(), 2, 2, [])
    assert [h.name for h in chosen] == ["mac1", "lnx1"]
    assert "busy" in left["mac2"] and "does not accept launches" in left["mac4"]


@pytest.mark.parametrize("where, names", [
    (["device=apple-*"], ["mac1", "mac3"]),
    (["host=mac*", "cores>=20"], ["mac1"]),
    (["state=any", "host=mac[12]"], ["mac1", "mac2"]),
    (["state=busy"], ["mac2"]),
    (["memory_gib>=32", "device=apple-silicon"], ["mac1", "mac3"]),
])
def test_where_terms_all_hold(where, names):
    chosen, _ = select_hosts(hosts(), 1, 10, where)
    assert sorted(h.name for h in chosen) == sorted(names)


def test_too_few_hosts_is_an_error_naming_each_left_out_host():
    with pytest.raises(ConfigError, match=r"1 host\(s\) can take the job, it needs at least 2: .*mac2: fails "
                                          r"state=idle \(it is busy"):
        select_hosts(hosts(), 2, 4, ["host=mac[12]"])


@pytest.mark.parametrize("term", ["cores>x", "colour=red", "state"])
def test_a_bad_where_term_says_what_is_allowed(term):
    with pytest.raises(ConfigError, match="is not one of state=S"):
        parse_where([term])


def test_run_needs_a_command_and_sane_counts(capsys):
    assert main(["run", "--host", "127.0.0.1:1", "-n", "2"]) == 2
    assert "needs a command after --" in capsys.readouterr().err
    assert main(["run", "--host", "127.0.0.1:1", "--min", "3", "--max", "2", "--", "python", "t.py"]) == 2
    assert "1 <= MIN <= MAX" in capsys.readouterr().err
