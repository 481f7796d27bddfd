"""The suite runs as one pytest session (scripts/test.sh, four xdist workers): two test files
of one basename in different folders stop its collection ("import file mismatch"), which the
former per-folder streams hid until a file moved between them."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_has_its_own_basename():
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        where[path.name].append(str(path.relative_to(TESTS)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
