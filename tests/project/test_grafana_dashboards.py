"""Static checks of grafana/: generated JSON is current, datasource and variables consistent."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"


def load_builder():
    spec = importlib.util.spec_from_file_location("build_dashboards", GRAFANA / "build_dashboards.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(10)
def test_committed_json_matches_the_generator():
    b = load_builder()
    for name, board in (("mccl-fleet.json", b.fleet()), ("mccl-job.json", b.job())):
        committed = json.loads((GRAFANA / "dashboards" / name).read_text())
        assert committed == json.loads(json.dumps(board)), \
            f"{name} is stale: run `python grafana/build_dashboards.py`"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["mccl-fleet.json", "mccl-job.json"])
def test_panels_use_the_datasource_variable_and_known_variables(name):
    board = json.loads((GRAFANA / "dashboards" / name).read_text())
    variables = {v["name"] for v in board["templating"]["list"]}
    assert "datasource" in variables
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":      # a section heading: no query of its own
            assert not p["panels"], p["title"]
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), f"{p['title']}: ${var} undefined"
            assert "mccl_" in t["expr"] or "up{" in t["expr"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["mccl-fleet.json", "mccl-job.json"])
def test_panels_do_not_overlap(name):
    """The SDK lays panels out only from left to right: a panel too wide for what is left of a line
    would overlap the next line, so a section that starts mid-line must start with a row."""
    cells = {}
    for p in json.loads((GRAFANA / "dashboards" / name).read_text())["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


@pytest.mark.timeout(10)
def test_provisioning_points_at_the_dashboards_datasource_uid():
    ds = (GRAFANA / "provisioning" / "datasources" / "mccl.yaml").read_text()
    assert re.search(r"^\s+uid: mccl-prometheus$", ds, re.M)
    board = json.loads((GRAFANA / "dashboards" / "mccl-fleet.json").read_text())
    (dsvar,) = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert dsvar["current"]["value"] == "mccl-prometheus"
    prov = (GRAFANA / "provisioning" / "dashboards" / "mccl.yaml").read_text()
    assert "type: file" in prov and "path:" in prov
