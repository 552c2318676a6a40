"""Benchmarks of mok against the anchors (run with `python -m mok bench` from the repository)."""

from __future__ import annotations

import csv
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path


def append_rows(path: Path, fields: Iterable[str], rows: Iterable[dict]) -> None:
    """Append rows to a CSV (the header first when the file is new or empty). A file whose
    header lacks some of `fields` (written before they existed) is rewritten first with the new
    header, its rows' new cells empty."""
    fields = list(fields)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            old_fields, old_rows = reader.fieldnames or [], list(reader)
        if old_fields != fields:
            missing = [name for name in old_fields if name not in fields]
            if missing:
                raise ValueError(f"{path} has columns {missing} these rows do not")
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(old_rows)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def commit_id() -> str:
    """The commit benchmark rows record: mok.provenance.commit_id (MOK_COMMIT when set, else the
    git commit of the tree holding the imported mok package, else "mok-<version>")."""
    from mok.provenance import commit_id as package_commit_id

    return package_commit_id()


def newest_gpu_rows(csv_path: Path, group: Callable[[dict], object], modes: Sequence[str],
                    *, other_modes: bool,
                    rename: Callable[[list[dict]], list[dict]] | None = None) -> list[dict]:
    """The last GPU row of each (group, impl, mode) in csv_path, as read (strings): groups and
    implementations in the order they first appear, modes in `modes`' order (other modes after
    them when other_modes, else left out); rename: maps the GPU rows, in the file's order,
    first (implementations renamed since). What the benchmarks' --redraw charts."""
    if not csv_path.is_file():
        raise SystemExit(f"no results to redraw at {csv_path}: name the CSV with --csv FILE "
                         "(the measured rows are under benchmarks/results/)")
    with csv_path.open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if not row["gpu"].startswith("cpu")
                and (other_modes or row["mode"] in modes)]
    if rename is not None:
        rows = rename(rows)
    newest = {(group(row), row["impl"], row["mode"]): row for row in rows}
    groups = list(dict.fromkeys(group(row) for row in rows))
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    return sorted(newest.values(), key=lambda row: (
        groups.index(group(row)), impls.index(row["impl"]),
        list(modes).index(row["mode"]) if row["mode"] in modes else len(modes)))


def finish_chart(figure, rows: list[dict], num_impls: int, title: str, path: Path,
                 max_cols: int = 7) -> None:
    """The legend of the first panel on top, the title with the GPU and every commit the rows
    come from, then save as PNG."""
    commits = ", ".join(dict.fromkeys(str(row["commit"]) for row in rows))
    # Wrapped to the figure's width (about 13 characters an inch at 10 points).
    text = textwrap.fill(title.format(gpu=rows[0]["gpu"], commits=commits),
                         width=int(figure.get_figwidth() * 13))
    extra = 0.2 * text.count("\n")  # inches a further title line takes
    height = figure.get_figheight()
    handles, labels = figure.axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="upper center", ncols=min(num_impls, max_cols), fontsize=8,
                  bbox_to_anchor=(0.5, 0.995 - (0.25 + extra) / height))
    figure.suptitle(text, fontsize=10)
    figure.tight_layout(rect=(0, 0, 1, 1 - (0.6 + extra) / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
