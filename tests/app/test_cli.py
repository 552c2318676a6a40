"""The command line, `python -m mok COMMAND`, run as a user runs it (a subprocess): the command
list, usage errors of one line naming the flag, unreadable checkpoints, the bench command outside
a source checkout, and Ctrl-C / SIGTERM during training saving a checkpoint that resumes.

Every subprocess runs in an empty folder with only the mok package importable (not benchmarks/),
on the CPU; the many quick cases start together to share the interpreter start-up time.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import mok
from mok.app import cli, train

PACKAGE = Path(mok.__file__).resolve().parent
TRAIN_FLAGS = ["--device", "cpu", "--no-progress"]
# One layer of the reference experts: a step takes milliseconds on a CPU.
MICRO = ["--size", "micro", "--backend", "reference", *TRAIN_FLAGS]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(an empty working folder, an environment where only mok is importable)."""
    root = tmp_path_factory.mktemp("cli")
    site = root / "site"
    site.mkdir()
    (site / "mok").symlink_to(PACKAGE, target_is_directory=True)
    work = root / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(site), PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    return work, env


def mok_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "mok", *args]


def run_mok(sandbox: tuple[Path, dict[str, str]], *args: str,
            timeout: float = 120) -> subprocess.CompletedProcess:
    work, env = sandbox
    return subprocess.run(mok_command(*args), cwd=work, env=env, capture_output=True, text=True,
                          timeout=timeout)


@dataclass(frozen=True)
class Case:
    """A command line, the exit status it must end with and what its last stderr line says.

    {name} in args and says stands for the path of the file or folder `name` (see _files).
    """

    args: tuple[str, ...]
    status: int
    says: tuple[str, ...] = ()
    usage: bool = False  # argparse's usage lines come before the error line


def _resume(name: str, *says: str) -> Case:
    return Case(("train", *MICRO, "--resume", "--out", f"{{{name}}}"), 1,
                ("mok train: --resume:", f"{{{name}}}/checkpoint.pt", *says))


BAD = {
    "unknown command": Case(("trian",), 2, ("unknown command 'trian'", "train, demo, bench")),
    "flag before any command": Case(("--steps", "5"), 2,
                                    ("--steps", "before any command", "train, demo, bench")),
    "batch-size 0": Case(("train", "--batch-size", "0"), 2,
                         ("argument --batch-size", "at least 1, got 0"), usage=True),
    "out is a file": Case(("train", "--out", "{plain}"), 2,
                          ("--out {plain} is a file, not a folder",), usage=True),
    "out under a file": Case(("train", *MICRO, "--out", "{plain}/run"), 1,
                             ("mok train: --out {plain}/run cannot be created",)),
    "corpus empty": Case(("train", "--corpus", "{empty}"), 2, ("--corpus {empty} is empty",),
                         usage=True),
    "corpus too short": Case(
        ("train", *MICRO, "--out", "run", "--corpus", "{short}"), 1,
        ("mok train: --corpus {short} holds 5,250 bytes; --seq-len 16 needs at least 9,233",)),
    "demo topk above experts": Case(("demo", "--experts", "4", "--topk", "5"), 2,
                                    ("--topk 5 exceeds --experts 4",), usage=True),
    "resume without checkpoint": _resume("no_ckpt", "no checkpoint at",
                                         "start without --resume"),
    "resume empty": _resume("ckpt_empty", "is empty (truncated or corrupt)"),
    "resume truncated": _resume("ckpt_truncated", "is truncated or corrupt"),
    "resume random bytes": _resume("ckpt_random", "is not a mok checkpoint"),
    "resume foreign dict": _resume("ckpt_foreign", "is not a mok checkpoint", "without model"),
    "resume pickled objects": _resume("ckpt_objects", "is not a mok checkpoint",
                                      "Python objects"),
}


def _files(folder: Path) -> dict[str, str]:
    """Inputs of the BAD cases: a plain file, corpora too small, and broken checkpoints."""
    folder.mkdir()
    files = {"plain": folder / "plain.txt", "empty": folder / "empty.txt",
             "short": folder / "short.txt"}
    files["plain"].write_text("not a folder\n")
    files["empty"].write_bytes(b"")
    files["short"].write_bytes(b"To be, or not to be. " * 250)  # 5,250 bytes

    def checkpoint(name: str, writer) -> None:
        files[name] = folder / name
        files[name].mkdir()
        writer(files[name] / "checkpoint.pt")

    checkpoint("no_ckpt", lambda path: None)
    checkpoint("ckpt_empty", lambda path: path.write_bytes(b""))
    checkpoint("ckpt_random", lambda path: path.write_bytes(bytes(range(256)) * 8))
    checkpoint("ckpt_foreign",
               lambda path: torch.save({"weights": torch.ones(3), "epoch": 2}, path))
    # A pickled object other than tensors and plain data: torch.load(weights_only=True) refuses.
    checkpoint("ckpt_objects", lambda path: torch.save({"model": Path("x")}, path))

    def truncated(path: Path) -> None:
        torch.save({"format": train.CHECKPOINT_FORMAT, "model": torch.zeros(4096)}, path)
        path.write_bytes(path.read_bytes()[:9000])

    checkpoint("ckpt_truncated", truncated)
    return {name: str(path) for name, path in files.items()}


@pytest.fixture(scope="module")
def quick(sandbox, tmp_path_factory) -> dict[str, tuple[Case, subprocess.CompletedProcess]]:
    """The help and bench commands and every BAD case, run concurrently: (case with its paths
    filled in, result) by name."""
    files = _files(tmp_path_factory.mktemp("cli_files") / "files")
    cases = {"help": Case(("--help",), 0), "-h": Case(("-h",), 0), "no command": Case((), 0),
             "bench": Case(("bench", "--shapes", "tiny"), 1), **BAD}
    cases = {name: Case(tuple(a.format(**files) for a in case.args), case.status,
                        tuple(s.format(**files) for s in case.says), case.usage)
             for name, case in cases.items()}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run_mok, sandbox, *case.args)
                   for name, case in cases.items()}
        return {name: (cases[name], future.result()) for name, future in futures.items()}


@pytest.mark.parametrize("name", ["help", "-h", "no command"])
def test_help_lists_the_commands(quick, name):
    result = quick[name][1]
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0] == "usage: python -m mok COMMAND [options]"
    for command in ("train", "demo", "bench"):
        assert sum(line.split()[:1] == [command] for line in lines) == 1, command
    assert "python -m mok train --help" in result.stdout
    assert "step" not in result.stdout  # no training started


@pytest.mark.parametrize("name", list(BAD))
def test_bad_command_line_is_one_line(quick, name):
    case, result = quick[name]
    assert result.returncode == case.status, result.stderr
    assert "Traceback" not in result.stderr and "weights_only" not in result.stderr
    assert result.stdout == ""  # nothing ran
    lines = result.stderr.splitlines()
    if case.usage:
        assert lines[0].startswith("usage: python -m mok ")
        assert ": error: " in lines[-1]
    else:
        assert len(lines) == 1
    for fragment in case.says:
        assert fragment in lines[-1]


def test_nothing_trained_in_the_working_folder(quick, sandbox):
    # `python -m mok`, `--steps 5` and the rest wrote no run (train's default --out is runs/).
    assert [p.name for p in sandbox[0].iterdir()] == []


def test_bench_outside_a_checkout_says_where_to_run_it(quick, sandbox):
    work, env = sandbox
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                            "print(u.find_spec('benchmarks') is None, u.find_spec('mok') is None)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["True", "False"]  # mok importable, benchmarks not
    result = quick["bench"][1]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "mok bench: the benchmarks ship with mok's source repository, not with the installed "
        "package: run it from the root of a clone (cd mok && python -m mok bench)"]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_saves_a_checkpoint_that_resumes(sandbox, tmp_path, signum):
    work, env = sandbox
    out = tmp_path / "run with space"
    total = 100_000
    proc = subprocess.Popen(
        mok_command("train", *MICRO, "--steps", str(total), "--log-every", "10",
                    "--sample-bytes", "0", "--eval-batches", "1", "--out", str(out)),
        cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(90, proc.kill)
    watchdog.start()
    try:
        logged = 0
        for line in proc.stdout:
            if line.startswith("step "):
                logged = int(line.split()[1].split("/")[0])
                if logged >= 30:
                    break
        assert logged >= 30, "the run ended before logging 30 steps"
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 128 + signum
    assert "Traceback" not in stderr
    message = stderr.strip().splitlines()[-1]
    checkpoint = train.load_checkpoint(out / "checkpoint.pt")
    step = checkpoint["step"]
    assert logged <= step < total
    assert len(checkpoint["losses"]) == len(checkpoint["aux_losses"]) == step
    assert checkpoint["format"] == train.CHECKPOINT_FORMAT
    assert [p.name for p in out.iterdir()] == ["checkpoint.pt"]  # no temporary file left
    assert message.startswith(f"mok train: stopped by {signal.Signals(signum).name}; ")
    assert f"holds step {step} of {total}" in message
    command = message.split("resume with: ", 1)[1]
    words = shlex.split(command)
    assert words == ["python", "-m", "mok", "train", "--resume", "--out", str(out),
                     "--device", "cpu"]
    # The printed command, with a shorter run, continues the run where the signal stopped it.
    more = step + 5
    resumed = subprocess.run([sys.executable, *words[1:], "--steps", str(more), "--no-progress",
                              "--sample-bytes", "0", "--eval-batches", "1"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {out / 'checkpoint.pt'} at step {step}" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_step"] == step and summary["steps"] == more
    assert len(summary["losses"]) == more
    assert summary["losses"][:step] == checkpoint["losses"]
    assert train.load_checkpoint(out / "checkpoint.pt")["step"] == more


# -- the rest of the option values, in this process (the parsers the subprocesses run) -------

@pytest.mark.parametrize("flag,value", [
    ("--steps", "0"), ("--steps", "-5"), ("--steps", "ten"), ("--schedule-steps", "0"),
    ("--warmup-steps", "-1"), ("--batch-size", "0"), ("--batch-size", "-8"), ("--seq-len", "0"),
    ("--seq-len", "-1"), ("--lr", "-1"), ("--lr", "0"), ("--lr", "nan"), ("--lr", "inf"),
    ("--lr", "-inf"), ("--lr", "fast"), ("--seed", "-1"), ("--seed", str(2**63)),
    ("--checkpoint-every", "0"), ("--log-every", "0"), ("--log-every", "-3"),
    ("--eval-batches", "0"), ("--sample-bytes", "-1"), ("--threads", "0"), ("--threads", "-2"),
    ("--device", "gpu"), ("--device", "meta"),
])
def test_train_rejects_values_out_of_range(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", *TRAIN_FLAGS, "--out", str(tmp_path / "run"), f"{flag}={value}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"python -m mok train: error: argument {flag}: ")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag,value,parsed", [
    ("--warmup-steps", "0", 0), ("--sample-bytes", "0", 0), ("--seed", "0", 0),
    ("--lr", "1e-4", 1e-4), ("--device", "cpu", "cpu"), ("--device", "cuda:1", "cuda:1"),
    ("--batch-size", "1", 1), ("--seq-len", "1", 1),
])
def test_train_accepts_values_at_the_edge(flag, value, parsed):
    args = train.parse_args([flag, value])
    assert getattr(args, flag[2:].replace("-", "_")) == parsed


@pytest.mark.parametrize("flag,value", [
    ("--tokens", "0"), ("--hidden", "0"), ("--hidden", "12"), ("--intermediate", "-8"),
    ("--intermediate", "20"), ("--experts", "0"), ("--topk", "0"), ("--shared", "-8"),
    ("--shared", "4"), ("--seed", "-1"),
])
def test_demo_rejects_values_out_of_range(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", f"{flag}={value}"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"python -m mok demo: error: argument {flag}: ")


@pytest.mark.parametrize("argv,says", [
    (["train", "--corpus", "{tmp}/gone.txt"], "--corpus {tmp}/gone.txt: no such file"),
    (["train", "--corpus", "{tmp}"], "--corpus {tmp} is a folder, not a file"),
    (["train", "--resume", "--compare"], "--resume and --compare cannot be combined"),
    (["demo", "--experts", "2", "--topk", "3"], "--topk 3 exceeds --experts 2"),
])
def test_inconsistent_options_are_usage_errors(argv, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([a.format(tmp=tmp_path) for a in argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error == f"python -m mok {argv[0]}: error: {says.format(tmp=tmp_path)}"


def test_corpus_must_hold_a_window_in_both_splits(tmp_path):
    for seq_len in (1, 16, 64, 1023, 1024, 1025, 5000):
        needed = train.minimum_corpus_bytes(seq_len)
        window = seq_len + 1
        train_data, val_data = train.split_corpus(torch.zeros(needed, dtype=torch.uint8))
        assert min(train_data.numel(), val_data.numel()) >= window, seq_len
        try:
            short = train.split_corpus(torch.zeros(needed - 1, dtype=torch.uint8))
        except ValueError:  # not even one block held out
            continue
        assert min(short[0].numel(), short[1].numel()) < window, seq_len
    with pytest.raises(SystemExit, match=r"the bundled corpus holds .* --seq-len 1000000 needs"):
        train.main([*TRAIN_FLAGS, "--out", str(tmp_path / "run"), "--seq-len", "1000000"])
