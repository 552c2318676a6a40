"""The GPU test log: which commit the GPU tests ran at, where, and what pytest said.

    python -m benchmarks.gpu_test_log --out-dir OUT/gpu-tests \\
        --group pytest.0.log 0 "python3 -m pytest -q -rfE tests/test_a.py" [--group ...]

scripts/gpu_check.sh and scripts/gpu_ep_check.sh call it after their pytest runs. It writes
OUT-DIR/<date>_<commit>[_<suite>].log (date UTC as YYYY-MM-DD, commit from mok.provenance): a
header (commit and where it came from, date UTC, GPU from nvidia-smi, torch/triton/python
versions, the mok environment switches, every pytest command) and, per group, its exit status,
its short test summary (the FAILED/ERROR lines of -rfE) and its final count line; the full
pytest output stays in the group's own log. The file is meant to be committed under
benchmarks/results/gpu-tests/, so that "the GPU tests passed at commit X" can be read there.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LOG_DIR = Path(__file__).resolve().parent / "results" / "gpu-tests"
MAX_SUMMARY_LINES = 80  # failures listed per group; more are counted, not listed
MAX_LINE_CHARS = 300
TAIL_LINES = 5  # of an output without a summary: where it stopped

# pytest's last line: "3 failed, 120 passed, 2 skipped in 301.2s (0:05:01)", "no tests ran in
# 0.1s", between "=" rules without -q.
_FINAL = re.compile(r"^(\d+ [a-z]+(, \d+ [a-z]+)*|no tests ran) in \d+(\.\d+)?s\b")
_SHORT_SUMMARY = re.compile(r"^=+ short test summary info =+$")
# pytest's exit statuses, and the time limit's (timeout's own, and SIGKILL's).
_STATUS = {0: "passed", 1: "tests failed", 2: "interrupted", 3: "pytest internal error",
           4: "pytest usage error", 5: "no tests collected", 124: "time limit reached",
           137: "killed (time limit)"}


@dataclass(frozen=True)
class Group:
    """One pytest run: its output file, its exit status (None: not known) and its command."""

    log: Path
    status: int | None
    command: str


def pytest_summary(text: str) -> tuple[list[str], str | None]:
    """(short test summary lines, final count line) of a pytest output; ([], None) when the run
    printed no final line (killed, or crashed). The short summary is what -r asked for: with -rfE
    a FAILED or ERROR line per failure, and pytest's "Interrupted" notes."""
    lines = [line.rstrip() for line in text.splitlines()]
    final_at = None
    for index in range(len(lines) - 1, -1, -1):
        if _FINAL.match(lines[index].strip("= ")):
            final_at = index
            break
    if final_at is None:
        return [], None
    short: list[str] = []
    for index in range(final_at - 1, -1, -1):
        if _SHORT_SUMMARY.match(lines[index]):
            short = [line for line in lines[index + 1:final_at] if line.strip()]
            break
    return short, lines[final_at].strip("= ")


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 3] + "..."


def describe_status(status: int | None) -> str:
    if status is None:
        return "exit status unknown"
    return f"exit status {status}: {_STATUS.get(status, 'failed')}"


def group_section(index: int, group: Group) -> list[str]:
    """A group's lines in the log: its status, its short summary and its final line."""
    lines = [f"== group {index} ({group.log.name}): {describe_status(group.status)}"]
    try:
        text = group.log.read_text(errors="replace")
    except OSError as error:
        return [*lines, f"no output to read: {type(error).__name__}: {error.strerror or error}"]
    short, final = pytest_summary(text)
    if final is None:
        tail = [line for line in text.splitlines() if line.strip()][-TAIL_LINES:]
        lines.append("no pytest summary line: the run did not finish; its last lines:")
        return lines + [f"  {_clip(line)}" for line in tail]
    lines += [_clip(line) for line in short[:MAX_SUMMARY_LINES]]
    if len(short) > MAX_SUMMARY_LINES:
        lines.append(f"... and {len(short) - MAX_SUMMARY_LINES} more lines in {group.log.name}")
    lines.append(final)
    return lines


def verdict(groups: Sequence[Group]) -> str:
    """One line: whether every group passed, else which did not."""
    failed = [str(index) for index, group in enumerate(groups) if group.status != 0]
    if not failed:
        return f"all {len(groups)} pytest groups passed"
    return f"NOT all passed: group(s) {', '.join(failed)} of {len(groups)} did not exit 0"


def render(groups: Sequence[Group], *, commit: str, commit_source: str,
           date: datetime.datetime, gpu: str, versions: dict[str, str],
           env: dict[str, str], suite: str | None = None) -> str:
    """The log's text: the header, the verdict, then each group's summary."""
    lines = [
        "# mok GPU test log, to be committed under benchmarks/results/gpu-tests/",
        f"suite: {suite or 'tests'}",
        f"commit: {commit} (from {commit_source})",
        f"date: {date.astimezone(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')}",
        f"gpu: {gpu}",
        "versions: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
        "env: " + (", ".join(f"{name}={value}" for name, value in sorted(env.items()))
                   or "no MOK_ or TRITON_ variables set"),
        "commands:",
        *(f"  [{index}] {group.command}" for index, group in enumerate(groups)),
        f"result: {verdict(groups)}",
        "",
    ]
    for index, group in enumerate(groups):
        lines += [*group_section(index, group), ""]
    return "\n".join(lines)


def log_path(out_dir: Path, date: datetime.datetime, commit: str, suite: str | None) -> Path:
    """OUT-DIR/<YYYY-MM-DD>_<commit>[_<suite>].log, the date in UTC; .2.log, .3.log, ... when
    that name is taken (another run of the same day and commit)."""
    safe_commit = re.sub(r"[^A-Za-z0-9._-]", "_", commit)
    stem = f"{date.astimezone(datetime.UTC):%Y-%m-%d}_{safe_commit}" + (f"_{suite}" if suite
                                                                        else "")
    path, number = out_dir / f"{stem}.log", 1
    while path.exists():
        number += 1
        path = out_dir / f"{stem}.{number}.log"
    return path


def write_log(out_dir: Path, groups: Sequence[Group], *, commit: str, commit_source: str,
              date: datetime.datetime, gpu: str, versions: dict[str, str],
              env: dict[str, str], suite: str | None = None) -> Path:
    """Write the log under out_dir (created if missing); returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = log_path(out_dir, date, commit, suite)
    path.write_text(render(groups, commit=commit, commit_source=commit_source, date=date,
                           gpu=gpu, versions=versions, env=env, suite=suite))
    return path


# -- what the machine is -----------------------------------------------------------------------

def gpu_description() -> str:
    """The GPUs as nvidia-smi names them ("2 x NVIDIA H200, driver 570.86.15"); else torch's
    name of the first CUDA device; else that none was found."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], text=True, capture_output=True,
                             check=True, timeout=60).stdout
        found = Counter(line.strip() for line in out.splitlines() if line.strip())
    except (OSError, subprocess.SubprocessError):
        found = Counter()
    if found:
        parts = []
        for line, number in found.items():
            name, _, driver = line.rpartition(",")
            text = f"{name.strip()}, driver {driver.strip()}" if name else line
            parts.append(text if number == 1 else f"{number} x {text}")
        return "; ".join(parts)
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (nvidia-smi gave no name)"
    return "no CUDA GPU found"


def library_versions() -> dict[str, str]:
    import torch
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__,
            "cuda": str(torch.version.cuda), "python": platform.python_version()}


def mok_environment() -> dict[str, str]:
    """The MOK_ and TRITON_ variables that change what the tests run, file paths shortened to
    their names (the commit is in the header already)."""
    return {name: Path(value).name if os.sep in value else value
            for name, value in os.environ.items()
            if name.startswith(("MOK_", "TRITON_")) and name != "MOK_COMMIT"}


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_test_log",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=LOG_DIR,
                        help="folder of the log (default: %(default)s)")
    parser.add_argument("--group", nargs=3, action="append", required=True,
                        metavar=("LOG", "STATUS", "COMMAND"),
                        help="a pytest run: its output file, exit status ('' if unknown) and "
                             "command line; once per run, in order")
    parser.add_argument("--suite", help="a name for the set of tests, added to the file name")
    args = parser.parse_args(argv)
    env = mok_environment()  # before mok's import, which may set TRITON_INTERPRET itself
    from mok.provenance import resolve_commit

    groups = [Group(Path(log), int(status) if status.strip() else None, command)
              for log, status, command in args.group]
    commit, source = resolve_commit()
    path = write_log(args.out_dir, groups, commit=commit, commit_source=source,
                     date=datetime.datetime.now(datetime.UTC), gpu=gpu_description(),
                     versions=library_versions(), env=env, suite=args.suite)
    print(f"GPU test log at commit {commit}: {path} ({verdict(groups)})")
    return path


if __name__ == "__main__":
    main()
