"""benchmarks.compare: the layer of an earlier commit and of the working tree, each in its own
process (on CPU the tiny shape under the interpreter: the tool's path, not its numbers)."""

import csv
import subprocess

import pytest

from benchmarks import compare


def _in_a_git_checkout() -> bool:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=compare.ROOT, capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not _in_a_git_checkout(), reason="the base tree comes from git archive")
@pytest.mark.parametrize("forward", [False, True], ids=["forward+backward", "forward"])
def test_both_trees_run_in_turns_and_every_measurement_is_a_row(tmp_path, capsys, forward):
    out = tmp_path / "compare.csv"
    compare.main(["--base", "HEAD", "--shapes", "tiny", "--rounds", "2", "--repeats", "1",
                  "--warmup", "0", "--csv", str(out), *(["--forward"] if forward else [])])
    printed = capsys.readouterr().out
    mode = "forward" if forward else "forward+backward"
    assert f"mok {mode}, bf16, ms per round" in printed
    # the rounds alternate the trees: base, new, base, new
    order = [line.split()[2] for line in printed.splitlines() if line.startswith("  round ")]
    assert order == ["base", "new", "base", "new"]
    table = [line.split() for line in printed.splitlines() if line.startswith("tiny ")]
    assert [row[1] for row in table] == ["base", "new"]
    assert table[1][-1].endswith("%")  # the new tree's change against the base
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["tree"], row["round"]) for row in rows] == [
        ("base", "1"), ("new", "1"), ("base", "2"), ("new", "2")]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=compare.ROOT,
                          capture_output=True, text=True).stdout.strip()
    assert {row["base"] for row in rows} == {head}
    assert {row["mode"] for row in rows} == {mode}
    assert {row["precision"] for row in rows} == {"bf16"}
    assert all(float(row["idle_ms"]) > 0 and float(row["host_ms"]) > 0 for row in rows)


@pytest.mark.skipif(not _in_a_git_checkout(), reason="the base tree comes from git archive")
def test_fp8_layers_compare_and_say_so(tmp_path, capsys):
    out = tmp_path / "compare.csv"
    compare.main(["--base", "HEAD", "--shapes", "tiny-fp8", "--rounds", "1", "--repeats", "1",
                  "--warmup", "0", "--precision", "fp8", "--fp8-weight-gradients",
                  "--csv", str(out)])
    assert ("mok forward+backward, fp8+fp8_weight_gradients, ms per round"
            in capsys.readouterr().out)
    with out.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["tree"] for row in rows] == ["base", "new"]
    assert {row["precision"] for row in rows} == {"fp8+fp8_weight_gradients"}


def test_a_base_is_required_and_fp8_weight_gradients_need_fp8():
    with pytest.raises(SystemExit):
        compare.main(["--shapes", "tiny"])
    with pytest.raises(SystemExit):
        compare.main(["--base", "HEAD", "--shapes", "tiny", "--fp8-weight-gradients"])
