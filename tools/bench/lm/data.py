"""The corpus every Python ships with: its standard library's own source files, as bytes.

``build`` lists the ``.py`` files under the interpreter's stdlib directory (sysconfig's
``stdlib`` path), without third-party packages (site-packages, dist-packages) or the test
suites (directories named test, tests, idle_test), sorted by relative path so every run on the
same Python reads the same list in the same order. A file goes to the validation split when the
CRC-32 of its relative path falls in a fixed bucket (about 1 in ``VAL_EVERY``), so the split does
not move when a file's content or the list around it changes. Each split is the concatenation of
its files, each followed by a NUL byte (a separator that source files do not contain).

Batches (``batches``) are windows of ``context + 1`` bytes at offsets drawn by a generator seeded
with (seed, rank): every backend and variant sees the same data order on each rank. Validation
(``val_windows``) is a fixed set of evenly spaced windows, split across ranks by index.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

VAL_EVERY = 20            # about 5 % of the files are held out
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    train_path: str
    val_path: str
    train_bytes: int
    val_bytes: int
    files: int
    val_files: int
    sha256: str            # of the file list and contents, both splits: names the corpus in results
    stdlib: str
    python: str

    def to_dict(self) -> dict:
        return asdict(self)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path | None = None) -> list[Path]:
    """The stdlib's own ``.py`` files, relative to ``root``, sorted."""
    root = stdlib_dir() if root is None else root
    out = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _SKIP_DIRS & set(rel.parts[:-1]) or not p.is_file():
            continue
        out.append(rel)
    return sorted(out, key=lambda r: r.as_posix())


def is_val(rel: Path) -> bool:
    return zlib.crc32(rel.as_posix().encode()) % VAL_EVERY == 0


def build(out_dir: str, root: Path | None = None) -> Corpus:
    """Write ``train.bin`` and ``val.bin`` (and ``corpus.json``) into ``out_dir``."""
    import platform

    root = stdlib_dir() if root is None else root
    files = source_files(root)
    if not files:
        raise FileNotFoundError(f"[bench] no .py files under the standard library at {root}")
    digest = hashlib.sha256()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for rel in files:
        data = (root / rel).read_bytes().replace(b"\0", b"")
        digest.update(rel.as_posix().encode() + b"\0" + data + b"\0")
        parts[is_val(rel)].append(data + b"\0")
    os.makedirs(out_dir, exist_ok=True)
    paths = {}
    for split, is_v in (("train", False), ("val", True)):
        paths[split] = os.path.join(out_dir, f"{split}.bin")
        with open(paths[split], "wb") as f:
            f.write(b"".join(parts[is_v]))
    corpus = Corpus(train_path=paths["train"], val_path=paths["val"],
                    train_bytes=os.path.getsize(paths["train"]), val_bytes=os.path.getsize(paths["val"]),
                    files=len(files), val_files=sum(1 for r in files if is_val(r)), sha256=digest.hexdigest(),
                    stdlib=str(root), python=platform.python_version())
    with open(os.path.join(out_dir, "corpus.json"), "w") as f:
        json.dump(corpus.to_dict(), f, indent=1)
    return corpus


def load_split(torch, path: str):
    """A split as a uint8 tensor (read once per rank; a few MB)."""
    with open(path, "rb") as f:
        raw = f.read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def sampler(torch, data, context: int, seed: int, rank: int):
    """``draw(b)`` -> (inputs, targets) of ``b`` windows: bytes [o, o+context) predict [o+1, o+context+1).
    The offsets come from a generator seeded with (seed, rank) alone; ``b`` may change from call to
    call (a balanced rank's share of the global batch)."""
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    hi = len(data) - context - 1
    if hi <= 0:
        raise ValueError(f"[bench] the training split has {len(data)} bytes, fewer than context {context} + 1")
    ar = torch.arange(context + 1)

    def draw(batch: int):
        off = torch.randint(0, hi, (batch,), generator=gen)
        win = data[off[:, None] + ar].long()
        return win[:, :-1], win[:, 1:]
    return draw


def global_sampler(torch, data, context: int, seed: int):
    """``draw(shares, rank)`` -> this rank's slice of the step's global batch: every rank draws the
    same ``sum(shares)`` offsets from one generator seeded with ``seed`` alone and keeps
    ``[sum(shares[:rank]), +shares[rank])``. Runs that split the global batch differently (equal
    shares, speed-balanced shares) then train on the same samples in the same steps, so their
    curves differ only by the update, not by the data."""
    gen = torch.Generator().manual_seed(seed * 100_003 + 99_991)
    hi = len(data) - context - 1
    if hi <= 0:
        raise ValueError(f"[bench] the training split has {len(data)} bytes, fewer than context {context} + 1")
    ar = torch.arange(context + 1)

    def draw(shares: list[int], rank: int):
        off = torch.randint(0, hi, (sum(shares),), generator=gen)
        lo = sum(shares[:rank])
        win = data[off[lo:lo + shares[rank], None] + ar].long()
        return win[:, :-1], win[:, 1:]
    return draw


def batches(torch, data, context: int, batch: int, seed: int, rank: int):
    """Endless batches of ``batch`` windows, the same as ``sampler``'s draws of that size."""
    draw = sampler(torch, data, context, seed, rank)
    while True:
        yield draw(batch)


def val_windows(torch, data, context: int, count: int, rank: int, world: int):
    """This rank's share of ``count`` evenly spaced validation windows (index i on rank i % world)."""
    hi = len(data) - context - 1
    if hi <= 0:
        raise ValueError(f"[bench] the validation split has {len(data)} bytes, fewer than context {context} + 1")
    offs = torch.linspace(0, hi, count).long()[rank::world]
    win = data[offs[:, None] + torch.arange(context + 1)].long()
    return win[:, :-1], win[:, 1:]
