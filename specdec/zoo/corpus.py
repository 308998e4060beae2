"""The zoo's corpus: Python source files every Python machine has.

Invariant: a file is held out if and only if a stable hash (SHA-256) of its relative path,
``stdlib/...`` or ``site-packages/...``, falls in the lowest ``held_out_fraction`` of the hash
range, so every machine splits the same files the same way, whatever else it has installed.
Evaluation prompts come from held-out files only.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_FRACTION = 0.05
MAX_FILE_BYTES = 512_000  # generated tables and vendored blobs teach little


@dataclass(frozen=True)
class SourceFile:
    relative_path: str  # "stdlib/json/decoder.py", "site-packages/numpy/..." : what the split hashes
    path: Path

    def read(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def stable_fraction(relative_path: str) -> float:
    """A number in [0, 1) that depends only on the path's text."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_held_out(relative_path: str, fraction: float = HELD_OUT_FRACTION) -> bool:
    return stable_fraction(relative_path) < fraction


def _python_files(root: Path, prefix: str, skip: set[Path]) -> list[SourceFile]:
    files = []
    for path in root.rglob("*.py"):
        if any(parent in skip for parent in path.parents) or not path.is_file():
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        files.append(SourceFile(f"{prefix}/{path.relative_to(root).as_posix()}", path))
    return files


def find_sources(include_site_packages: bool = False) -> list[SourceFile]:
    """The interpreter's standard library (and optionally installed packages), sorted by path."""
    paths = sysconfig.get_paths()
    stdlib = Path(paths["stdlib"])
    site_dirs = {Path(paths["purelib"]), Path(paths["platlib"])}
    files = _python_files(stdlib, "stdlib", skip=site_dirs | {stdlib / "site-packages"})
    if include_site_packages:
        seen = set()
        for site in sorted(site_dirs):
            if site.is_dir() and site not in seen:
                seen.add(site)
                files += _python_files(site, "site-packages", skip=set())
    unique = {f.relative_path: f for f in files}
    return [unique[k] for k in sorted(unique)]


def split(files: list[SourceFile], fraction: float = HELD_OUT_FRACTION) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out), disjoint, each in the order given."""
    held = [f for f in files if is_held_out(f.relative_path, fraction)]
    train = [f for f in files if not is_held_out(f.relative_path, fraction)]
    return train, held


def shuffled(files: list[SourceFile]) -> list[SourceFile]:
    """A machine-independent pseudo-random order (by a second hash of the path)."""
    return sorted(files, key=lambda f: stable_fraction("order:" + f.relative_path))
