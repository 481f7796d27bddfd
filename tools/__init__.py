"""Tools around MCCL, not part of it: the benchmark (``python -m tools.bench``), the emulated
fleet (``python -m tools.fleet``), the README's demo (``python -m tools.demo``) and the attach
benchmark (``python -m tools.bench_attach``). They run from a checkout and are not in the wheel;
they may import anything of ours, and nothing of the product imports them (tests/project/test_layers.py).
"""

import os
import sys

# The tools start their ranks, daemons and probes as ``python -m tools....`` in other network
# namespaces and working directories: make this checkout importable there too.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
