"""The README documents every setting exactly as it is declared."""
import dataclasses
from pathlib import Path

import pytest

import mccl_common.settings as config
import mccl_common.daemon_settings  # noqa: F401  (registers the daemon's settings)

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(30)
def test_readme_settings_table_matches_declarations():
    text = README.read_text()
    assert config.markdown_table() in text, (
        "README.md's settings table is stale: run `.venv/bin/python scripts/update_readme_settings.py`")
    names = [f.metadata["env"] for cls in config.ALL_SETTINGS for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), "a setting is declared twice"
    assert all(n.startswith("MCCL_") for n in names)
