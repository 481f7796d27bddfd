"""The README's settings table, every component's declarations in it
(``python -m mccl_common.settings_table``; scripts/update_readme_settings.py writes it in).

settings.py holds the registry and the engine's and rendezvous' declarations; a component
above it (daemon_settings.py) registers its own class when imported. This module sits above
both, so that the registry never has to import the components that register with it.
"""

from __future__ import annotations

import sys

from . import daemon_settings  # noqa: F401 - importing it registers DaemonConfig
from .settings import markdown_table


def main() -> None:
    sys.stdout.write(markdown_table() + "\n")


if __name__ == "__main__":  # pragma: no cover - a documentation helper
    main()
