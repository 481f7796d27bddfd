"""The package graph points one way (mccl_common/__init__.py draws it):

    mccl_common            imports nothing of ours
    libmccl._core          the engine (C++): bytes, dtypes, reduce ops
    libmccl                torch glue + daemon client   -> mccl_common, libmccl
    mccld                  the daemon                   -> mccl_common, libmccl._core
    mcclctl                the CLI                      -> mccl_common
    tools                  benchmark, fleet emulator, demo (not in the wheel) -> anything

Every import counts, also one inside a function or under ``if TYPE_CHECKING``; nothing of the
product imports the tools. A new upward or sideways import fails here, naming the file and the
line; so does an import circle among the product's modules (inside a package or across them):
two modules that need each other are one concept, or one of them wants a typed seam (a Protocol
the lower one declares and the higher one satisfies).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mccl_common", "libmccl", "mccld", "mcclctl", "tools")
ALLOWED = {
    "mccl_common": ("mccl_common",),
    "libmccl": ("mccl_common", "libmccl"),
    "mccld": ("mccl_common", "mccld", "libmccl._core"),
    "mcclctl": ("mccl_common", "mcclctl"),
    "tools": PACKAGES,
}


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``path``; ``from pkg import name`` counts
    as ``pkg.name`` (a module or a name of pkg: either way pkg.name is what it reaches)."""
    mod = _module_name(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return out


def _edges() -> list[tuple[str, int, str]]:
    edges = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = _module_name(path)
            for line, target in imports_of(path):
                if target.split(".")[0] in PACKAGES:
                    edges.append((mod, line, target))
    return edges


PRODUCT = ("mccl_common", "libmccl", "mccld", "mcclctl")


def module_graph(root: Path, packages: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line}, among the modules under ``root``/``packages``.
    ``from pkg import name`` reaches pkg.name when that is a module, else pkg itself."""
    files = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, dict[str, int]] = {}
    for mod, path in files.items():
        out = graph.setdefault(mod, {})
        for line, target in imports_of(path, root):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != mod:
                out.setdefault(target, line)
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as one circle
    through it, found by a walk from its first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                sccs.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for scc in sccs:
        members, path = set(scc), [scc[0]]
        while True:   # follow edges inside the set until a module repeats: that is a circle
            nxt = min(w for w in graph[path[-1]] if w in members)
            if nxt in path:
                circles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
    return circles


def _describe(graph: dict[str, dict[str, int]], circle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


# Circles that stand, each as (package, last name of the module that imports the package's
# __init__ back), so that a move of the module keeps it known. libmccl/__init__.py loads the
# backend in torch's creator hook and the backend reads BACKEND_NAME/DEVICES from the package:
# libmccl's part of issue 28 breaks it. Nothing else may be added here.
STANDING_CIRCLES = (("libmccl", "backend"),)


def _standing(circle: list[str]) -> bool:
    mods = set(circle)
    return any(len(mods) == 2 and pkg in mods and
               any(m.startswith(pkg + ".") and m.rpartition(".")[2] == last for m in mods)
               for pkg, last in STANDING_CIRCLES)


def test_no_import_circles_in_the_product() -> None:
    graph = module_graph(ROOT, PRODUCT)
    circles = [c for c in import_circles(graph) if not _standing(c)]
    assert not circles, "import circles (tests/project/test_layers.py):\n" + \
        "\n".join(_describe(graph, c) for c in circles)


def test_the_circle_check_sees_a_planted_circle(tmp_path: Path) -> None:
    """Negative control on a copy of mccld: one function-level import from jobs/p2p.py back
    to jobs/job.py (job imports p2p at module level) closes a circle the check must name."""
    import shutil
    shutil.copytree(ROOT / "mccld", tmp_path / "mccld", ignore=shutil.ignore_patterns("__pycache__"))
    assert import_circles(module_graph(tmp_path, ("mccld",))) == []
    p2p = tmp_path / "mccld" / "jobs" / "p2p.py"
    p2p.write_text(p2p.read_text() + "\n\ndef _planted():\n    from .job import Job\n    return Job\n")
    graph = module_graph(tmp_path, ("mccld",))
    assert import_circles(graph) == [["mccld.jobs.job", "mccld.jobs.p2p", "mccld.jobs.job"]]
    # ... and one at module level across two packages' folders (net <- jobs, then net -> jobs).
    p2p.write_text(p2p.read_text().replace("\n\ndef _planted():\n    from .job import Job\n    return Job\n", ""))
    ondemand = tmp_path / "mccld" / "net" / "ondemand.py"
    ondemand.write_text("from ..jobs import p2p\n" + ondemand.read_text())
    assert import_circles(module_graph(tmp_path, ("mccld",))) == \
        [["mccld.jobs.p2p", "mccld.net.ondemand", "mccld.jobs.p2p"]]


# mccld's folders, lowest first (mccld/README.md): a module in one may import the top-level
# helpers below, its own folder and the folders before it; daemon.py, attach.py and
# fd_inbox.py above them wire the folders together.
MCCLD_FOLDERS = ("net", "jobs", "host", "report")
MCCLD_HELPERS = ("mccld.logutil", "mccld.PROTO_VERSION", "mccld.__version__")


def test_mccld_folders_point_down() -> None:
    bad = []
    for mod, line, target in _edges():
        parts = mod.split(".")
        if parts[0] != "mccld" or len(parts) < 3 or not _under(target, ("mccld",)):
            continue
        folder = parts[1]
        assert folder in MCCLD_FOLDERS, f"mccld/{folder}/ is not one of {MCCLD_FOLDERS}"
        below = tuple(f"mccld.{f}" for f in MCCLD_FOLDERS[:MCCLD_FOLDERS.index(folder) + 1])
        if not _under(target, below + MCCLD_HELPERS):
            bad.append(f"{mod.replace('.', '/')}:{line}: {mod} imports {target}, which is not below mccld/{folder}/")
    assert not bad, "mccld's folders (tests/project/test_layers.py):\n" + "\n".join(bad)


def test_every_import_follows_the_layers() -> None:
    bad = []
    for mod, line, target in _edges():
        path = mod.replace(".", "/")
        if not _under(target, ALLOWED[mod.split(".")[0]]):
            bad.append(f"{path}:{line}: {mod} imports {target}; {mod.split('.')[0]} may import only "
                       f"{', '.join(ALLOWED[mod.split('.')[0]])}")
    assert not bad, "imports against the layers (tests/project/test_layers.py):\n" + "\n".join(bad)


def test_the_wheel_holds_the_product_and_no_tools() -> None:
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert build["tool"]["scikit-build"]["wheel"]["packages"] == ["mccl_common", "libmccl", "mccld", "mcclctl"]
    scripts = build["project"]["scripts"]
    assert not [s for s in scripts.values() if s.startswith("tools")], scripts


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """Negative control: the parser resolves relative, aliased and function-local imports."""
    f = ROOT / "mccl_common" / "_layers_probe.py"
    f.write_text("def f():\n    from libmccl.torch import backend\n    from . import errors as e\n"
                 "    import mccld.jobs.job\n")
    try:
        got = [t for _, t in imports_of(f)]
    finally:
        f.unlink()
    assert got == ["libmccl.torch.backend", "mccl_common.errors", "mccld.jobs.job"], got


def test_wire_tables_match_the_engine() -> None:
    _core = pytest.importorskip("libmccl._core")
    from mccl_common import wire

    assert [(m.name, int(m)) for m in sorted(_core.DType.__members__.values(), key=int)] == \
        [(n, i) for i, n in enumerate(wire.DTYPE_NAMES)]
    assert [int(m) for m in sorted(_core.ReduceOp.__members__.values(), key=int)] == list(range(len(wire.OP_NAMES)))
    assert [m.name.lower() for m in sorted(_core.ReduceOp.__members__.values(), key=int)] == list(wire.OP_NAMES)
    import numpy as np
    for code, size in enumerate(wire.DTYPE_SIZE):
        # The engine's own element size: reducing one element of 0x01 bytes into zeros changes
        # exactly that element's bytes (every pattern of 0x01 bytes is a normal or exact value).
        src, dst = np.full(16, 1, dtype=np.uint8), np.zeros(16, dtype=np.uint8)
        _core.reduce_inplace(src.ctypes.data, dst.ctypes.data, 1, code, wire.BOR if code == wire.BOOL else wire.SUM)
        assert int(np.count_nonzero(dst)) == size and dst[:size].all(), (wire.DTYPE_NAMES[code], size, dst)


def test_the_torch_glue_maps_onto_the_wire_codes() -> None:
    import torch

    from libmccl.torch import args
    from mccl_common import wire
    for dtype, code in args.DTYPE_CODES.items():
        assert wire.DTYPE_NAMES[code] == str(dtype).replace("torch.", ""), (dtype, code)
        assert torch.empty(0, dtype=dtype).element_size() == wire.DTYPE_SIZE[code], (dtype, code)


def test_libmccl_errors_is_the_public_name_of_the_same_classes() -> None:
    import libmccl.errors
    from mccl_common import errors

    assert libmccl.errors.__all__ == errors.__all__
    for name in errors.__all__:
        assert getattr(libmccl.errors, name) is getattr(errors, name), name


# The engine's folders, lowest first (libmccl/csrc/README.md draws them). A file may include
# its own folder and any folder listed before it; the top-level Metal bridge is its own.
ENGINE = ROOT / "libmccl" / "csrc"
ENGINE_LAYERS = ("core", "reduce", "compress", "integrity", "transport", "algorithms", "communicator",
                 "opqueue", "bindings")


def engine_include_violations(root: Path) -> list[str]:
    import re
    bad = []
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".h", ".cc") or path.parent == root:
            continue
        folder = path.relative_to(root).parts[0]
        if folder not in ENGINE_LAYERS:
            bad.append(f"{path.relative_to(root)}: folder {folder!r} is not one of the engine's layers")
            continue
        below = ENGINE_LAYERS[:ENGINE_LAYERS.index(folder) + 1]
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r'\s*#include "([a-z_]+)/', line)
            if m and m.group(1) not in below:
                bad.append(f"{path.relative_to(root)}:{lineno}: {folder} includes {m.group(1)}, "
                           f"which is above it")
    return bad


def test_engine_includes_point_down_the_layers() -> None:
    assert not [p for p in ENGINE.iterdir() if p.suffix in (".h", ".cc")], \
        "every engine source lives in one of the layer folders"
    assert engine_include_violations(ENGINE) == []


# The transport moves bytes: what a receive's bytes mean (dtypes, reductions) is the
# algorithms' business, handed down as a sink (transport/sink.h). reduce/ sits below the
# transport in ENGINE_LAYERS only because the folders are drawn in one line.
TRANSPORT_NEVER = ("reduce/", "core/dtype.h")


def transport_dtype_includes(root: Path) -> list[str]:
    """Files of transport/ that reach reduce/ or core/dtype.h, through any chain of includes."""
    import re
    def includes(rel: str) -> list[str]:
        path = root / rel
        return re.findall(r'^\s*#include "([^"]+)"', path.read_text(), re.M) if path.is_file() else []
    bad = []
    for path in sorted((root / "transport").glob("*")):
        if path.suffix not in (".h", ".cc"):
            continue
        start = str(path.relative_to(root))
        seen, todo = {start}, [(start, [start])]
        while todo:
            rel, chain = todo.pop()
            for inc in includes(rel):
                if inc.startswith(TRANSPORT_NEVER):
                    bad.append(" -> ".join(chain + [inc]))
                elif inc not in seen:
                    seen.add(inc)
                    todo.append((inc, chain + [inc]))
    return bad


def test_the_transport_knows_no_dtypes_or_reductions() -> None:
    assert transport_dtype_includes(ENGINE) == []


def test_the_transport_check_sees_an_indirect_include(tmp_path: Path) -> None:
    (tmp_path / "transport").mkdir()
    (tmp_path / "core").mkdir()
    (tmp_path / "transport" / "landing.h").write_text('#include "core/errors.h"\n')
    (tmp_path / "core" / "errors.h").write_text('#include "core/dtype.h"\n')
    (tmp_path / "transport" / "pair.h").write_text('#include "transport/frame.h"\n')
    assert transport_dtype_includes(tmp_path) == ["transport/landing.h -> core/errors.h -> core/dtype.h"]


def test_the_engine_check_sees_an_upward_include(tmp_path: Path) -> None:
    (tmp_path / "transport").mkdir()
    (tmp_path / "transport" / "pair.h").write_text('#include "core/errors.h"\n#include "algorithms/ring.h"\n')
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "dtype.h").write_text('#include "core/half.h"\n')
    found = engine_include_violations(tmp_path)
    assert len(found) == 1 and "transport includes algorithms" in found[0]
