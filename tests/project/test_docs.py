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


ROOT = README.parent
# The documentation pages: every relative link in them must reach a file, and every #anchor
# into a markdown page one of its headings (GitHub's slugs).
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs/dev").glob("*.md")),
         ROOT / "docs/results/README.md", ROOT / "mccld/README.md", ROOT / "libmccl/csrc/README.md"]


def _slug(heading: str) -> str:
    import re
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    import re
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.timeout(30)
def test_documentation_links_resolve():
    import re
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.timeout(10)
def test_the_index_and_the_architecture_page_link_the_folder_readmes():
    index = (ROOT / "docs/README.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert page.name == "README.md" or f"]({page.name}" in index, f"docs/README.md does not list {page.name}"
    arch = (ROOT / "docs/architecture.md").read_text()
    for target in ("../mccld/README.md", "../libmccl/csrc/README.md", "dev/interfaces.md"):
        assert f"]({target})" in arch, target
    for page in ("mccld/README.md", "libmccl/csrc/README.md", "docs/dev/interfaces.md"):
        assert "architecture.md" in (ROOT / page).read_text(), f"{page} does not link docs/architecture.md"
