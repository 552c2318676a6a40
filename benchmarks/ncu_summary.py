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

# Raw metrics (ncu --metrics, scripts/gpu_ncu.sh's second pass) listed per launch after the
# table, largest first: the tensor pipe's share of active cycles, and the warp stall reasons
# (warps stalled for that reason per issued instruction, so they add up to cyc/inst).
RAW_PREFIXES = ("sm__pipe_tensor", "smsp__average_warps_issue_stalled_")


def read_launches(text: str) -> list[tuple[str, str, dict[str, tuple[str, str]]]]:
    """[(launch id, kernel name, {metric name: (value, unit)})] in the order of the report."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit("no ncu CSV header (a line starting with \"ID\") in the input")
    launches: dict[str, tuple[str, dict]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("ID") or row.get("Metric Name") is None:
            continue
        _, metrics = launches.setdefault(row["ID"], (row.get("Kernel Name", "?"), {}))
        metrics[row["Metric Name"]] = (row.get("Metric Value", ""), row.get("Metric Unit", ""))
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
    """Per launch, the RAW_PREFIXES metrics of `text`, the `top` largest of each prefix."""
    out = []
    for launch, kernel, metrics in read_launches(text):
        parts = []
        for prefix in RAW_PREFIXES:
            found = []
            for name, (value, _) in metrics.items():
                try:
                    found.append((float(value.replace(",", "")), name))
                except ValueError:
                    continue
            found = sorted(((v, n) for v, n in found if n.startswith(prefix)), reverse=True)
            for value, name in found[:top]:
                short = name.removeprefix(prefix).split(".")[0].removesuffix("_per_issue_active")
                parts.append(f"{short}={value:.2f}")
        if parts:
            out.append(f"{launch:>4s} {kernel[:32]:32s} " + " ".join(parts))
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
        print("\ntensor pipe % of active cycles; warp stalls per issued instruction:")
        print(raw_metrics(args.raw.read_text(errors="replace")))


if __name__ == "__main__":
    main()
