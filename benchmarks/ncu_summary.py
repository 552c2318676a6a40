"""A table of the Nsight Compute metrics that place a kernel's bottleneck, from `ncu --csv --page
details` output (what scripts/gpu_ncu.sh writes): one row per profiled launch.

    python -m benchmarks.ncu_summary ncu.csv

Lines before the CSV header (ncu's own messages) are skipped; a metric a section did not report
shows as "-".
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

# (column title, ncu metric name), in the order printed.
METRICS = [
    ("us", "Duration"),
    ("SM %", "Compute (SM) Throughput"),
    ("mem %", "Memory Throughput"),
    ("DRAM %", "DRAM Throughput"),
    ("L2 %", "L2 Cache Throughput"),
    ("L1 %", "L1/TEX Cache Throughput"),
    ("L2 hit %", "L2 Hit Rate"),
    ("L1 hit %", "L1/TEX Hit Rate"),
    ("issue %", "Issue Slots Busy"),
    ("cyc/inst", "Warp Cycles Per Issued Instruction"),
    ("occ %", "Achieved Occupancy"),
    ("theo occ %", "Theoretical Occupancy"),
    ("regs", "Registers Per Thread"),
]

# Raw metrics (scripts/gpu_ncu.sh's second pass, --page raw) listed per launch after the table,
# largest first: (title, what the metric name contains, what it ends with).
RAW_GROUPS = [
    ("pipes, % of active cycles", "__pipe_", "cycles_active.avg.pct_of_peak_sustained_active"),
    ("warp stalls per issued instruction", "issue_stalled_", "_per_issue_active.ratio"),
]


def read_launches(text: str) -> list[tuple[str, str, dict[str, tuple[str, str]]]]:
    """[(launch id, kernel name, {metric name: (value, unit)})] in the order of the report, from
    `--page details` (a row per metric; where two sections name a metric alike, as "Memory
    Throughput" in % and in byte/s, the first is kept) or `--page raw` (a row per launch, a
    column per metric, the units in the row after the header)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("no ncu CSV header (a line starting with \"ID\") in the input")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    launches: dict[str, tuple[str, dict]] = {}
    if rows and "Metric Name" not in rows[0]:  # --page raw
        units = rows[0] if not rows[0].get("ID") else {}
        for row in rows:
            if row.get("ID"):
                launches[row["ID"]] = (row.get("Kernel Name", "?"), {
                    name: (value, units.get(name, "")) for name, value in row.items()})
        return [(launch, name, metrics) for launch, (name, metrics) in launches.items()]
    for row in rows:
        if not row.get("ID") or row.get("Metric Name") is None:
            continue
        _, metrics = launches.setdefault(row["ID"], (row.get("Kernel Name", "?"), {}))
        metrics.setdefault(row["Metric Name"], (row.get("Metric Value", ""),
                                                row.get("Metric Unit", "")))
    return [(launch, name, metrics) for launch, (name, metrics) in launches.items()]


def _value(metrics: dict, name: str) -> str:
    if name not in metrics:
        return "-"
    value, unit = metrics[name]
    value = value.replace(",", "")
    try:
        number = float(value)
    except ValueError:
        return value
    if unit in ("ms", "msecond"):
        number *= 1e3
    elif unit in ("ns", "nsecond"):
        number /= 1e3
    return f"{number:.1f}" if number < 1e4 else f"{number:.0f}"


def summary(text: str, name_width: int = 32) -> str:
    """The table of `read_launches(text)`."""
    header = f"{'id':>4s} {'kernel':{name_width}s} " + " ".join(
        f"{title:>9s}" for title, _ in METRICS)
    out = [header]
    for launch, kernel, metrics in read_launches(text):
        cells = " ".join(f"{_value(metrics, metric):>9s}" for _, metric in METRICS)
        out.append(f"{launch:>4s} {kernel[:name_width]:{name_width}s} {cells}")
    return "\n".join(out)


def raw_metrics(text: str, top: int = 8) -> str:
    """Per launch of `text`, the `top` largest metrics of each RAW_GROUPS group."""
    out = []
    for launch, kernel, metrics in read_launches(text):
        out.append(f"{launch:>4s} {kernel[:60]}")
        for title, part, end in RAW_GROUPS:
            found = []
            for name, (value, _) in metrics.items():
                if part not in name or not name.endswith(end):
                    continue
                try:
                    found.append((float(value.replace(",", "")), name))
                except ValueError:
                    continue
            found.sort(reverse=True)
            cells = [f"{name.split(part)[1].removesuffix(end).strip('_.')}={value:.2f}"
                     for value, name in found[:top]]
            out.append(f"     {title}: " + (" ".join(cells) or "-"))
    return "\n".join(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", type=Path, help="ncu --csv --page details output")
    parser.add_argument("raw", type=Path, nargs="?",
                        help="ncu --csv --page details output of a --metrics pass (optional)")
    args = parser.parse_args(argv)
    print(summary(args.csv.read_text(errors="replace")))
    if args.raw is not None and args.raw.exists():
        print()
        print(raw_metrics(args.raw.read_text(errors="replace")))


if __name__ == "__main__":
    main()
