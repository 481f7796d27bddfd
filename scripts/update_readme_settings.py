"""Rewrite the settings table in README.md from the declarations (python -m mccl_common.settings_table)."""
import re
import subprocess
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
table = subprocess.run([sys.executable, "-m", "mccl_common.settings_table"], check=True, capture_output=True,
                       text=True, cwd=root).stdout.strip()
readme = root / "README.md"
text = readme.read_text()
block = f"<!-- SETTINGS-TABLE -->\n{table}\n<!-- /SETTINGS-TABLE -->"
text = re.sub(r"<!-- SETTINGS-TABLE -->.*?(<!-- /SETTINGS-TABLE -->|$(?=\n\n##))", block, text, count=1, flags=re.S | re.M)
readme.write_text(text)
