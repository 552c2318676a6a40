"""The training job (`python -m mok train`, mok/app/train.py): summary, learning, exact resume, the
mok backend in a model, the hf comparison and its shared initial weights, stopping on a signal,
and checkpoints written atomically and recognized on load.

These run on the CPU (the reference backend, and the mok kernels under Triton's interpreter at a
micro size); the GPU test checks that a training step never waits for the device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import threading
from pathlib import Path

import pytest
import torch

from mok import provenance
from mok.app import cli, train
from mok.nn import MoE

COMMON = ["--device", "cpu", "--no-progress"]


def run(out: Path, *args: str, device: str = "cpu") -> dict:
    """`python -m mok train` in this process; returns the summary.json it wrote."""
    returned = train.main(["--device", device, "--no-progress", "--out", str(out), *args])
    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def expected_parameter_counts(c: train.ModelConfig) -> tuple[int, int]:
    attention = (c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
                 + 2 * c.head_dim)
    experts = 3 * c.num_experts * c.hidden_size * c.moe_intermediate_size
    shared = 3 * c.hidden_size * c.shared_intermediate_size
    block = attention + 2 * c.hidden_size + c.num_experts * c.hidden_size + experts + shared
    total = 2 * c.vocab_size * c.hidden_size + c.hidden_size + c.num_layers * block
    skipped = 3 * (c.num_experts - c.top_k) * c.hidden_size * c.moe_intermediate_size
    return total, total - c.num_layers * skipped


def test_tiny_run_learns_and_writes_summary(tmp_path):
    out = tmp_path / "run"
    cli.main(["train", *COMMON, "--out", str(out), "--size", "tiny", "--backend", "reference",
              "--steps", "40", "--sample-bytes", "16"])
    summary = json.loads((out / "summary.json").read_text())
    config = train.SIZES["tiny"].model
    assert summary["steps"] == 40 and len(summary["losses"]) == 40
    assert summary["device"] == "cpu" and summary["backend"] == "reference"
    assert summary["size"] == "tiny" and summary["resumed_from_step"] is None
    assert summary["mok_commit"] == provenance.commit_id()
    assert summary["config"]["model"] == dataclasses.asdict(config)
    assert summary["config"]["train"]["steps"] == 40
    assert (summary["params_total"], summary["params_active"]) == \
        expected_parameter_counts(config) == (255_360, 107_904)
    # A fresh model is close to uniform over 256 bytes; 40 steps take it well below.
    assert summary["initial_loss"] == summary["losses"][0]
    assert abs(summary["initial_loss"] - math.log(256)) < 0.3
    assert summary["final_loss"] == summary["losses"][-1]
    assert summary["final_loss"] < summary["initial_loss"] - 1.5
    assert summary["val_loss"] < summary["initial_loss"] - 1.0
    assert all(0 < a < 0.1 for a in summary["aux_losses"])  # ~ coef * num_layers when balanced
    assert summary["timed_steps"] == 40 - train.TIMING_WARMUP_STEPS
    assert summary["tokens_per_s"] > 0 and summary["tokens_per_step"] == 8 * 64
    assert summary["sample"].startswith("The ") and len(summary["sample"]) >= 4 + 16
    assert "compare" not in summary
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checkpoint = train.load_checkpoint(out / "checkpoint.pt")
    assert checkpoint["step"] == 40 and checkpoint["losses"] == summary["losses"]


def test_resume_continues_exactly(tmp_path):
    tiny = ["--size", "tiny", "--backend", "reference", "--sample-bytes", "0"]
    first = run(tmp_path / "resumed", *tiny, "--steps", "6", "--schedule-steps", "10")
    assert len(first["losses"]) == 6
    resumed = run(tmp_path / "resumed", "--resume", "--steps", "10", "--sample-bytes", "0")
    straight = run(tmp_path / "straight", *tiny, "--steps", "10")
    assert resumed["resumed_from_step"] == 6
    assert resumed["losses"][:6] == first["losses"]
    # Same weights, optimizer state, schedule position and batches: bitwise the same run.
    assert resumed["losses"] == straight["losses"]
    assert resumed["aux_losses"] == straight["aux_losses"]
    assert resumed["val_loss"] == straight["val_loss"]
    assert resumed["config"] == straight["config"]
    with pytest.raises(SystemExit, match="batch-size"):
        train.main([*COMMON, "--out", str(tmp_path / "resumed"), "--resume", "--steps", "12",
                    "--batch-size", "4"])


def test_resume_reads_the_corpus_and_reporting_options_of_its_checkpoint(tmp_path):
    # Resumed without --corpus, --eval-batches or --sample-bytes, the run is the uninterrupted
    # one: the checkpoint names its corpus (and the bytes it held) and those options.
    corpus = tmp_path / "digits.txt"
    corpus.write_bytes(bytes(48 + (i * 7 + i // 13) % 10 for i in range(20_000)))
    tiny = ["--size", "tiny", "--backend", "reference", "--corpus", str(corpus),
            "--eval-batches", "1", "--sample-bytes", "4"]
    run(tmp_path / "resumed", *tiny, "--steps", "4", "--schedule-steps", "8")
    resumed = run(tmp_path / "resumed", "--resume", "--steps", "8")
    straight = run(tmp_path / "straight", *tiny, "--steps", "8")
    assert resumed["losses"] == straight["losses"] and resumed["val_loss"] == straight["val_loss"]
    assert resumed["sample"] == straight["sample"] and len(resumed["sample"]) < 4 + 64
    assert resumed["config"] == straight["config"]
    assert resumed["config"]["corpus"] == str(corpus.resolve())
    other = tmp_path / "other.txt"
    other.write_bytes(corpus.read_bytes()[::-1])
    with pytest.raises(SystemExit, match="other bytes than the corpus the checkpoint's run"):
        train.main([*COMMON, "--out", str(tmp_path / "resumed"), "--resume", "--steps", "9",
                    "--corpus", str(other)])


def test_mok_backend_trains_like_the_reference(tmp_path):
    micro = ["--size", "micro", "--steps", "2", "--eval-batches", "1", "--sample-bytes", "2"]
    # The kernels run where mok runs them: compiled on a GPU, interpreted on CPU.
    fused = run(tmp_path / "mok", *micro, "--backend", "mok", device="auto")
    reference = run(tmp_path / "reference", *micro, "--backend", "reference", device="auto")
    assert fused["backend"] == "mok" and len(fused["losses"]) == 2
    assert all(math.isfinite(v) for v in fused["losses"])
    assert abs(fused["initial_loss"] - math.log(256)) < 0.5
    # Same weights and batches; the two differ only by the kernels' bf16 rounding.
    for got, want in zip(fused["losses"], reference["losses"], strict=True):
        assert abs(got - want) < 1e-2
    assert abs(fused["val_loss"] - reference["val_loss"]) < 1e-2


def test_mok_fp8_backend_runs_its_experts_in_fp8():
    # --backend mok_fp8: the model's MoE layers in FP8 (experts 96 wide: one partial scale
    # block), its loss within FP8's error of the reference backend's on the same weights and
    # tokens.
    config = train.ModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                               head_dim=32, moe_intermediate_size=96, num_experts=4, top_k=2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = torch.randint(0, config.vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for backend in ("mok_fp8", "reference"):
        model = train.build_model(config, backend, 0, device)
        if backend == "mok_fp8":
            assert all(layer.moe.precision == "fp8" for layer in model.layers)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        assert all(p.grad is not None and bool(p.grad.isfinite().all())
                   for p in model.parameters() if p.requires_grad)
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) < 2e-2 * losses[1]


def test_compare_trains_hf_from_the_same_start(tmp_path):
    out = tmp_path / "compare"
    summary = run(out, "--size", "tiny", "--backend", "reference", "--steps", "3",
                  "--compare", "--sample-bytes", "0", "--eval-batches", "2")
    compare = summary["compare"]
    assert set(compare) == {"reference", "hf", "speedup"}
    ours, hf = compare["reference"], compare["hf"]
    assert ours["losses"] == summary["losses"] and ours["tokens_per_s"] == summary["tokens_per_s"]
    assert hf["backend"] == "hf" and len(hf["losses"]) == 3
    assert compare["speedup"] == pytest.approx(ours["tokens_per_s"] / hf["tokens_per_s"])
    # Identical initial weights and batches: the curves differ by rounding only (mok.nn.MoE
    # runs its experts in bf16, Hugging Face's block in fp32 here; hf adds no aux loss).
    assert abs(ours["initial_loss"] - hf["initial_loss"]) < 1e-2
    assert abs(ours["final_loss"] - hf["final_loss"]) < 5e-2
    assert (out / "loss.png").stat().st_size > 0


def test_hf_block_starts_from_mok_weights():
    config = dataclasses.replace(train.SIZES["micro"].model, num_layers=2,
                                       shared_intermediate_size=16)
    ours = train.build_model(config, "reference", seed=3, device=torch.device("cpu"))
    hf = train.build_model(config, "hf", seed=3, device=torch.device("cpu"))
    outside = [{name: p for name, p in model.named_parameters() if ".moe." not in name}
               for model in (ours, hf)]
    assert outside[0].keys() == outside[1].keys()
    for name, parameter in outside[0].items():
        assert torch.equal(parameter, outside[1][name]), name
    assert ours.parameter_counts() == hf.parameter_counts() == expected_parameter_counts(config)
    for layer, hf_layer in zip(ours.layers, hf.layers, strict=True):
        moe, block = layer.moe, hf_layer.moe.block
        assert isinstance(moe, MoE) and isinstance(hf_layer.moe, train.HFSparseMoE)
        assert torch.equal(block.gate.weight, moe.router.weight)
        assert torch.equal(block.experts.gate_up_proj, torch.cat((moe.w_gate, moe.w_up), dim=1))
        assert torch.equal(block.experts.down_proj, moe.w_down)
        assert torch.equal(hf_layer.moe.shared_expert.gate_proj.weight, moe.shared_gate)
        assert torch.equal(hf_layer.moe.shared_expert.down_proj.weight, moe.shared_down)
        x = torch.randn(2, 5, config.hidden_size, generator=torch.Generator().manual_seed(0))
        y_ours, y_hf = moe(x), hf_layer.moe(x)
        assert y_hf.shape == y_ours.shape == x.shape
        assert hf_layer.moe.aux_loss is None
        # mok.nn.MoE rounds fp32 weights and inputs to bf16 for its experts.
        torch.testing.assert_close(y_ours, y_hf, rtol=2e-2, atol=2e-2)


def test_batches_and_split_are_deterministic():
    corpus = train.load_corpus()
    assert corpus.numel() > 50_000 and int(corpus.max()) < 128  # ASCII text
    train_data, val_data = train.split_corpus(corpus)
    assert train_data.numel() + val_data.numel() == corpus.numel()
    assert 0.05 < val_data.numel() / corpus.numel() < 0.15
    sampler = train.BatchSampler(train_data, 4, 32, seed=1, stream=0, device=torch.device("cpu"))
    again = train.BatchSampler(train_data, 4, 32, seed=1, stream=0, device=torch.device("cpu"))
    inputs, targets = sampler.batch(7)
    assert inputs.shape == targets.shape == (4, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the next bytes
    assert torch.equal(inputs, again.batch(7)[0])
    assert not torch.equal(inputs, sampler.batch(8)[0])


def test_learning_rate_schedule():
    config = train.TrainConfig(steps=50, schedule_steps=100, warmup_steps=10, batch_size=1,
                               seq_len=8, lr=1.0, min_lr_ratio=0.1)
    multipliers = [train.lr_multiplier(step, config) for step in range(120)]
    assert multipliers[0] == pytest.approx(0.1) and multipliers[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(multipliers[9:], multipliers[10:], strict=False))
    assert multipliers[55] == pytest.approx(0.55)  # half way down the cosine
    assert multipliers[100] == multipliers[119] == pytest.approx(0.1)
    # A warmup as long as the schedule: flat at the minimum from schedule_steps on.
    short = dataclasses.replace(config, schedule_steps=10)
    assert train.lr_multiplier(9, short) == pytest.approx(1.0)
    assert train.lr_multiplier(10, short) == train.lr_multiplier(11, short) == 0.1


@pytest.mark.gpu
def test_training_step_never_waits_for_the_gpu():
    device = torch.device("cuda")
    preset = train.SIZES["tiny"]
    config = train.TrainConfig(steps=3, schedule_steps=3, warmup_steps=1,
                               batch_size=preset.batch_size, seq_len=preset.seq_len, lr=1e-3)
    model = train.build_model(preset.model, "mok", seed=0, device=device)
    optimizer = train.build_optimizer(model, config, device)
    sampler = train.BatchSampler(train.split_corpus(train.load_corpus())[0], config.batch_size,
                                 config.seq_len, seed=0, stream=0, device=device)
    inputs, targets = sampler.batch(0)
    losses = [train.train_step(model, optimizer, inputs, targets, lr=1e-3, grad_clip=1.0,
                               device=device)[0]]  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in (1, 2):
            sampler.batch(step)  # drawing a batch does not wait either
            losses.append(train.train_step(model, optimizer, inputs, targets, lr=1e-3,
                                           grad_clip=1.0, device=device)[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    values = torch.stack(losses).tolist()
    assert all(math.isfinite(v) for v in values) and values[2] < values[0]


MICRO = ["--size", "micro", "--backend", "reference", "--sample-bytes", "0",
         "--eval-batches", "1"]


def test_signal_stops_after_the_step_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    handlers = {s: signal.getsignal(s) for s in train.STOP_SIGNALS}
    step = train.train_step
    calls = []

    def step_then_terminate(*args, **kwargs):
        calls.append(len(calls))
        result = step(*args, **kwargs)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)  # as `kill` would, between two steps
        return result

    monkeypatch.setattr(train, "train_step", step_then_terminate)
    with pytest.raises(SystemExit) as exit_info:
        run(tmp_path / "stopped", *MICRO, "--steps", "8", "--checkpoint-every", "100")
    assert exit_info.value.code == 128 + signal.SIGTERM and len(calls) == 3
    assert {s: signal.getsignal(s) for s in train.STOP_SIGNALS} == handlers
    checkpoint_path = tmp_path / "stopped" / "checkpoint.pt"
    assert capsys.readouterr().err.splitlines() == [
        f"mok train: stopped by SIGTERM; {checkpoint_path} holds step 3 of 8; resume with: "
        f"python -m mok train --resume --out {tmp_path / 'stopped'} --device cpu"]
    checkpoint = train.load_checkpoint(checkpoint_path)
    assert checkpoint["step"] == 3 and len(checkpoint["losses"]) == 3
    assert not (tmp_path / "stopped" / "summary.json").exists()
    monkeypatch.setattr(train, "train_step", step)
    resumed = run(tmp_path / "stopped", "--resume", "--sample-bytes", "0", "--eval-batches", "1")
    straight = run(tmp_path / "straight", *MICRO, "--steps", "8")
    assert resumed["resumed_from_step"] == 3
    assert resumed["losses"] == straight["losses"] and resumed["val_loss"] == straight["val_loss"]
    assert {s: signal.getsignal(s) for s in train.STOP_SIGNALS} == handlers


def test_a_second_signal_acts_at_once():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), train.stop_on_signals() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.signum == signal.SIGINT  # the first one only asks to stop
            signal.raise_signal(signal.SIGINT)
            pytest.fail("the second SIGINT did not interrupt")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_signals_are_left_alone_outside_the_main_thread():
    handlers = {s: signal.getsignal(s) for s in train.STOP_SIGNALS}
    seen = []

    def body():
        with train.stop_on_signals() as stop:
            seen.append(({s: signal.getsignal(s) for s in train.STOP_SIGNALS}, stop.signum))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(handlers, None)]


def test_checkpoints_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    train.save_atomically({"step": 1}, path)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(train.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))

    def save_half_then_die(obj, file):
        file.write(b"PK\x03\x04 half of an archive")
        raise KeyboardInterrupt  # a second Ctrl-C in the middle of the save

    real_save = torch.save
    monkeypatch.setattr(train.torch, "save", save_half_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.save_atomically({"step": 2}, path)
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
    monkeypatch.setattr(train.torch, "save", real_save)
    train.save_atomically({"step": 3}, path)
    assert torch.load(path, weights_only=True) == {"step": 3}
    assert len(synced) >= 1  # the file's data reached the disk before the rename
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_checkpoint_format(tmp_path):
    out = tmp_path / "run"
    run(out, *MICRO, "--steps", "2")
    path = out / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    assert state["format"] == train.CHECKPOINT_FORMAT
    assert state["format_version"] == train.CHECKPOINT_VERSION
    assert set(train.CHECKPOINT_KEYS) <= set(state)
    # Checkpoints from before the format marker still load: they hold every key.
    older = {k: v for k, v in state.items() if k not in ("format", "format_version")}
    torch.save(older, path)
    assert train.load_checkpoint(path)["step"] == 2
    resumed = run(out, "--resume", "--steps", "3", "--sample-bytes", "0", "--eval-batches", "1")
    assert resumed["resumed_from_step"] == 2 and len(resumed["losses"]) == 3
    for changes, says in [
        ({"format_version": train.CHECKPOINT_VERSION + 1}, "format version 2; this mok reads"),
        ({"format": "other.tool"}, "is not a mok checkpoint (format 'other.tool')"),
        ({"model_config": {"hidden_size": 64, "layers": 3}}, "configs this mok cannot build"),
        ({"step": -1}, "invalid step"),
    ]:
        torch.save({**state, **changes}, path)
        with pytest.raises(train.CheckpointError, match=re.escape(says)):
            train.load_checkpoint(path)
    del state["optimizer"]
    torch.save(state, path)
    with pytest.raises(SystemExit, match=r"--resume: .* is an incomplete mok checkpoint \(no "
                                         r"optimizer\)"):
        train.main([*COMMON, "--out", str(out), "--resume"])


def test_step_modes_on_cpu(tmp_path):
    cpu = torch.device("cpu")
    assert train.resolve_step_mode("auto", cpu) == "eager"
    for mode in ("graph", "compile"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            train.resolve_step_mode(mode, cpu)
        with pytest.raises(SystemExit, match="--step-mode"):
            run(tmp_path / mode, *MICRO, "--steps", "2", "--step-mode", mode)
        assert not (tmp_path / mode).exists()
    with pytest.raises(ValueError, match="capturable"):
        train.build_optimizer(torch.nn.Linear(2, 2), CONFIG, cpu,
                              capturable=True)
    summary = run(tmp_path / "eager", *MICRO, "--steps", "2", "--step-mode", "eager")
    assert summary["step_mode"] == "eager"


CONFIG = train.TrainConfig(steps=4, schedule_steps=4, warmup_steps=1, batch_size=2, seq_len=16,
                           lr=1e-3)


def test_train_step_keeps_the_learning_rate_when_none():
    cpu = torch.device("cpu")
    model = train.build_model(train.SIZES["micro"].model, "reference", seed=0, device=cpu)
    optimizer = train.build_optimizer(model, CONFIG, cpu)
    inputs = torch.randint(0, 256, (CONFIG.batch_size, CONFIG.seq_len))
    train.set_lr(optimizer, 2.5e-4)
    train.train_step(model, optimizer, inputs, inputs, lr=None, grad_clip=1.0, device=cpu)
    assert [group["lr"] for group in optimizer.param_groups] == [2.5e-4, 2.5e-4]
    stepper = train.Stepper(model, optimizer, CONFIG, cpu, "eager")
    stepper(inputs, inputs, lr=1e-4)
    assert stepper.mode == "eager"
    assert [group["lr"] for group in optimizer.param_groups] == [1e-4, 1e-4]


def _deterministic_steps(mode: str, steps: int) -> tuple[list[float], dict]:
    """Losses and final weights of `steps` mok steps of the tiny model in one step mode, with
    attention in its deterministic math kernel (the others add in any order)."""
    device = torch.device("cuda")
    preset = train.SIZES["tiny"]
    config = dataclasses.replace(CONFIG, steps=steps, schedule_steps=steps,
                                 batch_size=preset.batch_size, seq_len=preset.seq_len)
    model = train.build_model(preset.model, "mok", seed=0, device=device)
    optimizer = train.build_optimizer(model, config, device, capturable=True)
    initial = {name: t.clone() for name, t in model.state_dict().items()}
    stepper = train.Stepper(model, optimizer, config, device, mode)
    assert stepper.mode == mode
    for name, tensor in model.state_dict().items():  # capturing left the weights as they were
        assert torch.equal(tensor, initial[name]), name
    sampler = train.BatchSampler(train.split_corpus(train.load_corpus())[0], config.batch_size,
                                 config.seq_len, seed=0, stream=0, device=device)
    losses = []
    for step in range(steps):
        inputs, targets = sampler.batch(step)
        losses.append(stepper(inputs, targets, lr=1e-3 * (step + 1))[0].clone())
    return torch.stack(losses).tolist(), {n: t.clone() for n, t in model.state_dict().items()}


@pytest.mark.gpu
def test_graphed_step_is_the_eager_step_bitwise():
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        eager_losses, eager_weights = _deterministic_steps("eager", 5)
        graph_losses, graph_weights = _deterministic_steps("graph", 5)
    assert graph_losses == eager_losses
    for name, tensor in graph_weights.items():
        assert torch.equal(tensor, eager_weights[name]), name
    assert eager_losses[-1] < eager_losses[0]


@pytest.mark.gpu
def test_compiled_step_trains_like_the_eager_one():
    eager_losses, _ = _deterministic_steps("eager", 5)
    compiled_losses, _ = _deterministic_steps("compile", 5)
    # torch.compile fuses the model's fp32 elementwise work: rounding differs, not the run
    assert compiled_losses == pytest.approx(eager_losses, rel=2e-2)


def test_checkpoints_hold_the_learning_rate_as_a_float():
    # A capturable optimizer keeps it in a device tensor; a checkpoint must load either way.
    cpu = torch.device("cpu")
    model = train.build_model(train.SIZES["micro"].model, "reference", seed=0, device=cpu)
    optimizer = train.build_optimizer(model, CONFIG, cpu)
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(3e-4)
    state = train._portable_state(optimizer)
    assert [group["lr"] for group in state["param_groups"]] == [pytest.approx(3e-4)] * 2
    assert all(type(group["lr"]) is float for group in state["param_groups"])
    assert all(isinstance(group["lr"], torch.Tensor) for group in optimizer.param_groups)


def test_set_lr_fills_a_shared_tensor():
    cpu = torch.device("cpu")
    model = train.build_model(train.SIZES["micro"].model, "reference", seed=0, device=cpu)
    optimizer = train.build_optimizer(model, CONFIG, cpu)
    shared = torch.tensor(1e-3)
    for group in optimizer.param_groups:
        group["lr"] = shared
    train.set_lr(optimizer, 2e-4)
    assert all(group["lr"] is shared for group in optimizer.param_groups)
    assert shared.item() == pytest.approx(2e-4)
