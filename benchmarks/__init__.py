"""Benchmarks of mok against the anchors (run with `python -m mok bench` from the repository)."""

from __future__ import annotations

import csv
import subprocess
from collections.abc import Iterable
from pathlib import Path


def append_rows(path: Path, fields: Iterable[str], rows: Iterable[dict]) -> None:
    """Append rows to a CSV (the header first when the file is new or empty)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def commit_id() -> str:
    """The commit benchmark rows record: MOK_COMMIT when set (a copy of the tree, whose .git, if
    any, need not be the code's history), else git's short HEAD (+ -dirty)."""
    from mok import _env

    if _env.COMMIT != "unknown":
        return _env.COMMIT
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, text=True, capture_output=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
