"""The main job: train a small mixture-of-experts language model, `python -m mok train`.

The model is a decoder-only transformer in Qwen3-MoE's style (RMSNorm before each sublayer,
causal self-attention with grouped key/value heads, per-head RMSNorm on queries and keys, rotary
positions, residual connections) whose feed-forward in every block is `mok.nn.MoE`. It reads bytes
(vocabulary 256) of the public-domain English text shipped in `mok/app/data/corpus.txt`: the King
James Bible (Genesis 1-3, Psalms, Ecclesiastes, Matthew 5-7, Luke 2, 1 Corinthians 13),
Shakespeare's sonnets and speeches, Lewis Carroll's Alice (chapter 1, verses), the first chapters
of Austen's Pride and Prejudice, Lincoln's Gettysburg Address and Aesop's fables.

Backends of the feed-forward (`--backend`):
  mok        the fused Triton kernels (compiled on a GPU; on CPU, Triton's interpreter, which takes
             seconds per layer and step even for the tiny model).
  mok_fp8    mok with MoE(precision="fp8"): the experts' row GEMMs on e4m3 operands with
             blockwise scales (the weight gradients in bf16); its weights quantized once a step.
  reference  mok.reference, the pure-PyTorch layer, behind the same module and parameters.
  hf         Hugging Face's Qwen3MoeSparseMoeBlock, built with the same sizes and started from the
             same weights (copied from a mok.nn.MoE created with the same seed), with transformers'
             grouped_mm experts (--hf-experts eager: its loop over experts). Its load-balancing
             loss lives at the model level in transformers, so the hf runs add no auxiliary loss.
  auto       mok on CUDA, reference on CPU.

Steps (`--step-mode`): on CUDA by default the model runs under torch.compile and each step (forward,
backward, gradient clipping, AdamW) is one CUDA graph replay, so the host issues a step in
microseconds; `graph` captures the eager step; `eager` runs it as written (the CPU default).

Precision: bf16 autocast on CUDA, where every backend's experts compute in bf16 from the fp32
weights; fp32 on CPU, where the reference and hf experts compute in fp32 and mok's kernels
(--backend mok) in bf16.

Every step's batch is a function of (seed, step) alone and the initial weights of (seed, config),
so runs are reproducible, `--resume` continues a run exactly where its checkpoint left it, and
`--compare` trains the hf block on the same weights and batches as the selected backend.

Outputs in --out: summary.json, loss.png and checkpoint.pt. Checkpoints are written to a
temporary file, synced and renamed over checkpoint.pt, so an interrupted save leaves the previous
one whole. Ctrl-C (SIGINT) or SIGTERM stops the run after the step in progress, saves it and prints
the command that resumes it; the exit status is then 130 or 143.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import shlex
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as torch_f
from torch import nn
from tqdm import tqdm

from mok import provenance
from mok.nn import MoE, RouterConfig

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
VOCAB_SIZE = 256  # bytes
BACKENDS = ("mok", "mok_fp8", "reference", "hf")
# The mok.nn.MoE backend of each: hf's block starts from a reference MoE's weights.
MOE_BACKENDS = {"mok": "mok", "mok_fp8": "mok", "reference": "reference", "hf": "reference"}
HF_EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm")
TIMING_WARMUP_STEPS = 3  # steps left out of tokens/s: Triton compilation, allocator warm-up
SAMPLE_PROMPT = b"The "
SAMPLE_BYTES = 64  # generated at the end of a run (--sample-bytes)
SAMPLE_TEMPERATURE = 0.8
CHECKPOINT_FORMAT = "mok.train"
CHECKPOINT_VERSION = 1
# What train_run reads from a checkpoint; older checkpoints without the format keys hold these too.
CHECKPOINT_KEYS = ("model", "optimizer", "step", "losses", "aux_losses", "rng_cpu", "rng_cuda",
                   "model_config", "train_config", "backend", "size", "hf_experts")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive


# -- configuration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the MoE language model (Qwen3-MoE's shape, scaled down).

    Every block has num_heads query heads and num_kv_heads key/value heads of head_dim each, and
    a mok.nn.MoE feed-forward: num_experts routed SwiGLU experts of moe_intermediate_size, top_k
    of them per token, plus a shared expert of shared_intermediate_size when that is not 0 (Qwen3
    MoE has none).
    """

    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    moe_intermediate_size: int = 64
    num_experts: int = 8
    top_k: int = 2
    shared_intermediate_size: int = 0
    # Qwen3-MoE's router_aux_loss_coef, here the weight of mok's aux loss (RouterConfig), which
    # for one layer is 1/top_k of transformers' load_balancing_loss_func; and the model sums
    # its layers' losses, where transformers takes one loss over every layer's tokens.
    aux_loss_coef: float = 0.001
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary positions)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must lie in [1, {self.num_experts}]")


@dataclass(frozen=True)
class TrainConfig:
    """What decides the trajectory of a run: optimizer, schedule, batches and seed.

    The learning rate warms up linearly over warmup_steps, then follows a cosine down to
    lr * min_lr_ratio at schedule_steps and stays there. schedule_steps is the run's planned length;
    it is kept apart from steps so that a run stopped early and resumed follows the same schedule
    as one run straight through.
    """

    steps: int
    schedule_steps: int
    warmup_steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class SizePreset:
    """A model and the training defaults that go with it."""

    model: ModelConfig
    batch_size: int
    seq_len: int
    lr: float
    steps: int
    log_every: int
    checkpoint_every: int
    eval_batches: int


SIZES: dict[str, SizePreset] = {
    # One small layer: what the Triton interpreter can run in a second per step (tests).
    "micro": SizePreset(
        ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                    moe_intermediate_size=32, num_experts=4, top_k=2),
        batch_size=2, seq_len=16, lr=3e-3, steps=20, log_every=5, checkpoint_every=100,
        eval_batches=2),
    # The CPU default: a step of the reference backend takes tens of milliseconds.
    "tiny": SizePreset(
        ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    moe_intermediate_size=64, num_experts=8, top_k=2),
        batch_size=8, seq_len=64, lr=3e-3, steps=1000, log_every=50, checkpoint_every=250,
        eval_batches=8),
    # The GPU default, the one worth measuring: 164M parameters, 32M active; 16,384 tokens a
    # step (the token count of the layer benchmark's qwen3-30b-a3b shape).
    "small": SizePreset(
        ModelConfig(hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4, head_dim=64,
                    moe_intermediate_size=256, num_experts=32, top_k=4),
        batch_size=16, seq_len=1024, lr=1e-3, steps=200, log_every=25, checkpoint_every=100,
        eval_batches=4),
    # The training benchmark's model (benchmarks/train.py): Qwen3-MoE's expert layout (128
    # experts, top-8, no shared expert) at hidden 1024; 1,020,931,712 parameters (1.02B), 77.2M
    # active; 16,384 tokens a step. Weights, gradients and AdamW state take 16 GB and a step's
    # activations about 10 GB (estimated, Hugging Face's eager block the largest): one H200
    # holds it without gradient checkpointing.
    "1b": SizePreset(
        ModelConfig(hidden_size=1024, num_layers=5, num_heads=16, num_kv_heads=4, head_dim=64,
                    moe_intermediate_size=512, num_experts=128, top_k=8),
        batch_size=16, seq_len=1024, lr=5e-4, steps=200, log_every=25, checkpoint_every=200,
        eval_batches=4),
}


def resolve_device(name: str) -> torch.device:
    """auto: CUDA when a GPU is present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("mok train: --device cuda: no CUDA device is available")
    return device


def resolve_backend(name: str, device: torch.device) -> str:
    """auto: mok on CUDA; on CPU the reference, as the interpreted kernels are slow."""
    if name == "auto":
        return "mok" if device.type == "cuda" else "reference"
    return name


def resolve_size(name: str, device: torch.device) -> str:
    """auto: small (the measured config) on CUDA, tiny on CPU."""
    if name == "auto":
        return "small" if device.type == "cuda" else "tiny"
    return name


# -- data ------------------------------------------------------------------------------------

def load_corpus(path: str | Path | None = None) -> torch.Tensor:
    """The corpus as a 1-D uint8 tensor of bytes (the shipped one unless path is given)."""
    data = Path(path or CORPUS_PATH).read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def split_corpus(data: torch.Tensor, block_size: int = 1024,
                 validation_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): every validation_every-th block of block_size bytes is held out.

    Interleaved blocks rather than the tail, so that validation covers every work in the corpus.
    """
    blocks = data.split(block_size)
    validation = [b for i, b in enumerate(blocks) if i % validation_every == validation_every - 1]
    train = [b for i, b in enumerate(blocks) if i % validation_every != validation_every - 1]
    if not validation:
        raise ValueError(f"corpus of {data.numel()} bytes is too small to hold out a block")
    return torch.cat(train), torch.cat(validation)


class BatchSampler:
    """Random windows of seq_len + 1 bytes (inputs and next-byte targets).

    Batch i is drawn from a generator seeded with (seed, stream, i) alone, so any step's batch
    can be drawn again: a resumed run needs only the step it stopped at. On CUDA the windows
    travel from pinned memory without blocking the host.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, seq_len: int, *, seed: int,
                 stream: int, device: torch.device) -> None:
        if data.numel() < seq_len + 1:
            raise ValueError(f"{data.numel()} bytes cannot hold a window of {seq_len + 1}")
        self.data, self.batch_size, self.seq_len = data, batch_size, seq_len
        self.seed, self.stream, self.device = seed, stream, device
        self.offsets = torch.arange(seq_len + 1)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch_size, seq_len] int64 on the device."""
        generator = torch.Generator().manual_seed(
            ((self.seed * 1_000_003 + self.stream) * 1_000_000_007 + index) % 2**63)
        starts = torch.randint(0, self.data.numel() - self.seq_len, (self.batch_size,),
                               generator=generator)
        windows = self.data[starts[:, None] + self.offsets].long()
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        else:
            windows = windows.to(self.device)
        return windows[:, :-1], windows[:, 1:]


# -- model -----------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [seq_len, head_dim // 2] fp32 of the rotary position embedding."""
    inverse_frequency = theta ** -(torch.arange(0, head_dim, 2, device=device).float()
                                   / head_dim)
    angles = torch.arange(seq_len, device=device).float()[:, None] * inverse_frequency
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the two halves of x [..., S, head_dim] (Qwen's and Llama's convention)."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.to(x.dtype)


class CausalSelfAttention(nn.Module):
    """Grouped-query causal attention with per-head RMSNorm on queries and keys (Qwen3)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, seq_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, seq_len, self.num_kv_heads, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = torch_f.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the hf backend's stand-in for mok's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch_f.silu(self.gate_proj(x)) * self.up_proj(x))


class HFSparseMoE(nn.Module):
    """Hugging Face's Qwen3MoeSparseMoeBlock holding a copy of a mok.nn.MoE's weights.

    router.weight [E, H] -> gate.weight; w_gate, w_up [E, I, H] -> experts.gate_up_proj
    [E, 2I, H] (gate rows first, as the block chunks them); w_down [E, H, I] ->
    experts.down_proj. transformers 4.x's per-expert Linear modules are filled the same way.
    A shared expert, which Qwen3-MoE has not, becomes a SwiGLU added to the block's output.
    `aux_loss` is None: transformers computes the balancing loss at the model level.
    """

    def __init__(self, moe: MoE, experts_implementation: str = "grouped_mm") -> None:
        super().__init__()
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        config = Qwen3MoeConfig(
            hidden_size=moe.hidden_size, moe_intermediate_size=moe.intermediate_size,
            num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=True,
            hidden_act="silu", experts_implementation=experts_implementation)
        factory = dict(device=moe.w_gate.device, dtype=moe.w_gate.dtype)
        # Keep the global RNG where it was, so that the layers built after this one get the
        # same initial weights as in a mok model (every weight here is overwritten anyway).
        with torch.random.fork_rng(devices=[]):
            self.block = Qwen3MoeSparseMoeBlock(config).to(**factory)
            self.shared_expert = (SwiGLU(moe.hidden_size, moe.shared_intermediate_size)
                                  .to(**factory) if moe.shared_intermediate_size else None)
        self._copy_weights(moe)
        self.aux_loss: torch.Tensor | None = None

    @torch.no_grad()
    def _copy_weights(self, moe: MoE) -> None:
        self.block.gate.weight.copy_(moe.router.weight)
        experts = self.block.experts
        if hasattr(experts, "gate_up_proj"):  # transformers 5.x: fused 3-D parameters
            _copy_checked(experts.gate_up_proj, torch.cat((moe.w_gate, moe.w_up), dim=1))
            _copy_checked(experts.down_proj, moe.w_down)
        else:  # transformers 4.x: one MLP module per expert
            for index, expert in enumerate(experts):
                _copy_checked(expert.gate_proj.weight, moe.w_gate[index])
                _copy_checked(expert.up_proj.weight, moe.w_up[index])
                _copy_checked(expert.down_proj.weight, moe.w_down[index])
        if self.shared_expert is not None:
            _copy_checked(self.shared_expert.gate_proj.weight, moe.shared_gate)
            _copy_checked(self.shared_expert.up_proj.weight, moe.shared_up)
            _copy_checked(self.shared_expert.down_proj.weight, moe.shared_down)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        device_type = hidden_states.device.type
        if torch.is_autocast_enabled(device_type):
            # transformers' grouped_mm path computes in the weights' dtype (torch's grouped_mm
            # ignores autocast), fp32 for fp32 master weights: hand the block copies in the
            # autocast dtype, as mok.nn.MoE does with its own weights (gradients flow back).
            dtype = torch.get_autocast_dtype(device_type)
            weights = {name: p.to(dtype) for name, p in self.block.named_parameters()}
            out = torch.func.functional_call(self.block, weights, (hidden_states,))
        else:
            out = self.block(hidden_states)
        if isinstance(out, tuple):  # transformers 4.x returns (hidden_states, router_logits)
            out = out[0]
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        return out


def _copy_checked(destination: torch.Tensor, source: torch.Tensor) -> None:
    if destination.shape != source.shape:
        raise ValueError(f"Hugging Face parameter of shape {tuple(destination.shape)} cannot "
                         f"take mok's {tuple(source.shape)}: unexpected transformers layout")
    destination.copy_(source)


class DecoderBlock(nn.Module):
    """x + attention(norm(x)), then + moe(norm(x))."""

    def __init__(self, config: ModelConfig, backend: str, hf_experts: str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attention = CausalSelfAttention(config)
        self.moe_norm = RMSNorm(config.hidden_size, config.norm_eps)
        moe = MoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                  config.top_k, config.shared_intermediate_size,
                  router=RouterConfig(aux_loss_coef=config.aux_loss_coef),
                  backend=MOE_BACKENDS[backend],
                  precision="fp8" if backend == "mok_fp8" else "bf16")
        self.moe: MoE | HFSparseMoE = HFSparseMoE(moe, hf_experts) if backend == "hf" else moe

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.moe(self.moe_norm(x))


class MoELanguageModel(nn.Module):
    """Byte-level decoder-only transformer with a mixture-of-experts feed-forward per block.

    forward(tokens [B, S] int64) -> logits [B, S, vocab]. After each forward, aux_loss() is the
    sum of the blocks' router losses (zero for the hf backend).
    """

    def __init__(self, config: ModelConfig, backend: str = "reference",
                 hf_experts: str = "grouped_mm") -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        self.config, self.backend = config, backend
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config, backend, hf_experts)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta,
                                 tokens.device)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' auxiliary losses from the last forward (fp32 scalar)."""
        total = self.lm_head.weight.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            if layer.moe.aux_loss is not None:
                total = total + layer.moe.aux_loss
        return total

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token): active leaves out the routed experts a token skips."""
        total = sum(p.numel() for p in self.parameters())
        c = self.config
        skipped = 3 * c.hidden_size * c.moe_intermediate_size * (c.num_experts - c.top_k)
        return total, total - c.num_layers * skipped


def build_model(config: ModelConfig, backend: str, seed: int, device: torch.device,
                hf_experts: str = "grouped_mm") -> MoELanguageModel:
    """The model with the initial weights of (config, seed), whatever the backend.

    The weights are drawn on the CPU, so that they do not depend on the device either.
    """
    torch.manual_seed(seed)
    return MoELanguageModel(config, backend, hf_experts).to(device)


# -- training --------------------------------------------------------------------------------

def lr_multiplier(step: int, config: TrainConfig) -> float:
    """Linear warmup to 1, then a cosine to min_lr_ratio at schedule_steps, then flat (from
    schedule_steps on, a warmup as long as the schedule or longer included)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if step >= config.schedule_steps:
        return config.min_lr_ratio
    decay_steps = max(1, config.schedule_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device, *,
                    capturable: bool = False) -> torch.optim.AdamW:
    """AdamW; matrices (and the experts' 3-D weights) decay, norm weights do not.

    capturable: safe to capture in a CUDA graph (CUDA only); the learning rate is then one fp32
    device tensor shared by both groups, set with `set_lr`.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    lr: float | torch.Tensor = config.lr
    if capturable:
        if device.type != "cuda":
            raise ValueError("a capturable optimizer needs a CUDA device")
        lr = torch.tensor(config.lr, dtype=torch.float32, device=device)
    groups = [{"params": decay, "weight_decay": config.weight_decay, "lr": lr},
              {"params": no_decay, "weight_decay": 0.0, "lr": lr}]
    # The fused CUDA kernel keeps the step count on the device: no host sync in the step.
    return torch.optim.AdamW(groups, lr=lr, betas=(config.beta1, config.beta2),
                             fused=device.type == "cuda", capturable=capturable)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets every group's learning rate (in place when it is a device tensor: no host sync; a
    tensor the groups share is filled once)."""
    filled: set[int] = set()
    for group in optimizer.param_groups:
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = lr
        elif id(group["lr"]) not in filled:
            filled.add(id(group["lr"]))
            group["lr"].fill_(lr)


def autocast_context(device: torch.device, *,
                     cache: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (cache=False for CUDA-graph capture); fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: MoELanguageModel, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor, *, lr: float | None, grad_clip: float,
               device: torch.device,
               autocast_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on (inputs, targets); returns (cross-entropy, auxiliary loss) as
    detached device scalars. Nothing in it waits for the GPU (with the mok backend).
    lr None keeps the optimizer's learning rate."""
    if lr is not None:
        set_lr(optimizer, lr)
    with autocast_context(device, cache=autocast_cache):
        logits = model(inputs)
        lm_loss = torch_f.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        aux_loss = model.aux_loss()
    optimizer.zero_grad(set_to_none=True)
    (lm_loss + aux_loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return lm_loss.detach(), aux_loss.detach()


class GraphedStep:
    """`train_step` captured once in a CUDA graph and replayed: one launch a step, so the host
    issues a step in microseconds whatever the model's kernel count.

    The optimizer must be built with capturable=True. Capturing runs `warmup` steps on a
    batch of zeros first (compilation, optimizer state, allocator); the weights and the
    optimizer's state are put back in place afterwards (also when capturing fails), so the run
    continues exactly as an eager one from the same state. The call copies the batch into the
    graph's static inputs, sets the learning rate and replays; it returns the graph's own
    (cross-entropy, auxiliary loss) tensors, overwritten by the next call.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: TrainConfig, device: torch.device, *, warmup: int = 3) -> None:
        if device.type != "cuda":
            raise ValueError("a CUDA graph needs a CUDA device")
        if not all(group.get("capturable") for group in optimizer.param_groups):
            raise ValueError("GraphedStep needs an optimizer built with capturable=True")
        for group in optimizer.param_groups:  # e.g. a float restored from a checkpoint
            if not (isinstance(group["lr"], torch.Tensor) and group["lr"].device == device):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32,
                                           device=device)
        self.optimizer = optimizer
        shape = (config.batch_size, config.seq_len)
        self.inputs = torch.zeros(shape, dtype=torch.int64, device=device)
        self.targets = torch.zeros(shape, dtype=torch.int64, device=device)
        saved_model = {name: t.detach().clone() for name, t in model.state_dict().items()}
        saved_state = {id(p): {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                               for k, v in state.items()}
                       for p, state in optimizer.state.items()}
        saved_lr = [group["lr"].detach().clone() for group in optimizer.param_groups]

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            return train_step(model, optimizer, self.inputs, self.targets, lr=None,
                              grad_clip=config.grad_clip, device=device, autocast_cache=False)

        # Warm-up and capture on one side stream: the autograd nodes kept alive between steps
        # (the router's losses) then belong to the stream that replays them.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        try:
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    step()
            optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):
                self.losses = step()
        finally:
            torch.cuda.current_stream(device).wait_stream(stream)
            with torch.no_grad():
                for name, tensor in model.state_dict().items():
                    tensor.copy_(saved_model[name])
                for p, state in optimizer.state.items():
                    before = saved_state.get(id(p), {})
                    for key, value in state.items():
                        if isinstance(value, torch.Tensor):
                            if key in before:
                                value.copy_(before[key])
                            else:
                                value.zero_()  # fresh state: AdamW's first step starts at zeros
                for group, lr in zip(optimizer.param_groups, saved_lr, strict=True):
                    group["lr"].copy_(lr)
                optimizer.zero_grad(set_to_none=True)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, *,
                 lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.inputs.copy_(inputs)
        self.targets.copy_(targets)
        set_lr(self.optimizer, lr)
        self.graph.replay()
        return self.losses


STEP_MODES = ("auto", "eager", "graph", "compile")


def resolve_step_mode(name: str, device: torch.device) -> str:
    """auto: compile on CUDA, eager on CPU; graph and compile need CUDA."""
    if name not in STEP_MODES:
        raise ValueError(f"step mode {name!r} is not one of {STEP_MODES}")
    if name == "auto":
        return "compile" if device.type == "cuda" else "eager"
    if name != "eager" and device.type != "cuda":
        raise ValueError(f"step mode {name!r} captures CUDA graphs: it needs a CUDA device")
    return name


class Stepper:
    """Runs training steps in one mode:

      eager    `train_step` as written.
      graph    the step captured in a CUDA graph (`GraphedStep`).
      compile  the model under torch.compile, its step captured as in graph.

    A mode that fails to set up (compilation, capture) falls back to eager with a message;
    `mode` is the one that runs. graph and compile need the optimizer built with capturable=True.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 config: TrainConfig, device: torch.device, mode: str) -> None:
        self.model, self.optimizer, self.config, self.device = model, optimizer, config, device
        self.mode = mode
        self.graphed: GraphedStep | None = None
        if mode in ("graph", "compile"):
            try:
                stepped = torch.compile(model) if mode == "compile" else model
                self.graphed = GraphedStep(stepped, optimizer, config, device)
            except Exception as exc:  # noqa: BLE001 - any failure to set up: run eagerly
                tqdm.write(f"mok train: the {mode} step could not be set up "
                           f"({type(exc).__name__}: {_first_line(exc)}); running eagerly")
                self.mode = "eager"

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, *,
                 lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.graphed is not None:
            return self.graphed(inputs, targets, lr=lr)
        return train_step(self.model, self.optimizer, inputs, targets, lr=lr,
                          grad_clip=self.config.grad_clip, device=self.device)


@torch.no_grad()
def evaluate(model: MoELanguageModel, sampler: BatchSampler, num_batches: int,
             device: torch.device) -> float:
    """Mean cross-entropy (nats per byte) over num_batches fixed validation batches."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for index in range(num_batches):
        inputs, targets = sampler.batch(index)
        with autocast_context(device):
            logits = model(inputs)
        total += torch_f.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    model.train(was_training)
    return total.item() / num_batches


@torch.no_grad()
def generate(model: MoELanguageModel, prompt: bytes, num_bytes: int, context: int,
             device: torch.device, *, seed: int, temperature: float = SAMPLE_TEMPERATURE) -> bytes:
    """prompt followed by num_bytes sampled bytes (temperature sampling, seeded)."""
    was_training = model.training
    model.eval()
    tokens = list(prompt)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(num_bytes):
        window = torch.tensor([tokens[-context:]], device=device)
        with autocast_context(device):
            logits = model(window)[0, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1).cpu()
        tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    model.train(was_training)
    return bytes(tokens)


@dataclass
class RunOptions:
    """How a run reports and saves; none of these change its trajectory."""

    log_every: int
    checkpoint_every: int
    eval_batches: int
    sample_bytes: int
    hf_experts: str
    progress: bool = True
    step_mode: str = "eager"  # eager, graph or compile (resolve_step_mode)
    # What a resumed run reads back from the checkpoint: the corpus and these options.
    saved: dict = dataclasses.field(default_factory=dict)


@dataclass
class RunResult:
    """What one training run measured."""

    backend: str
    losses: list[float]
    aux_losses: list[float]
    val_loss: float
    tokens_per_s: float | None
    timed_steps: int
    train_seconds: float
    params_total: int
    params_active: int
    start_step: int
    sample: bytes | None
    step_mode: str = "eager"

    def brief(self) -> dict:
        """The entry of this run in summary.json's compare section."""
        return {"backend": self.backend, "initial_loss": self.losses[0],
                "final_loss": self.losses[-1], "val_loss": self.val_loss,
                "tokens_per_s": self.tokens_per_s, "timed_steps": self.timed_steps,
                "train_seconds": self.train_seconds, "step_mode": self.step_mode,
                "losses": self.losses}


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or not one that train_run wrote."""


def _portable_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with each group's learning rate a float, as an optimizer built
    with or without capturable=True takes it (a capturable one holds it in a device tensor)."""
    state = optimizer.state_dict()
    for group in state["param_groups"]:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = group["lr"].item()
    return state


def _save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                     step: int, losses: list[float], aux_losses: list[float],
                     model_config: ModelConfig, train_config: TrainConfig, backend: str,
                     size: str, hf_experts: str, saved: dict) -> None:
    state = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "model": model.state_dict(),
        "optimizer": _portable_state(optimizer),
        "step": step,  # the next step to run: the schedule position and the data position
        "losses": losses,
        "aux_losses": aux_losses,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "model_config": dataclasses.asdict(model_config),
        "train_config": dataclasses.asdict(train_config),
        "backend": backend,
        "size": size,
        "hf_experts": hf_experts,
        "settings": saved,
    }
    save_atomically(state, path)


def save_atomically(obj: object, path: Path) -> None:
    """torch.save(obj) to path through a temporary file in the same folder, synced to disk and
    renamed over path: a crash or kill while saving leaves the previous file whole."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    # The rename itself reaches the disk once the folder is synced (POSIX; not on Windows).
    with contextlib.suppress(OSError):
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def load_checkpoint(path: Path) -> dict:
    """A checkpoint written by train_run, loaded on the CPU.

    Raises CheckpointError, with a one-line reason, when path is missing, empty, truncated or
    holds anything else than a mok training checkpoint.
    """
    try:
        with open(path, "rb") as file:
            head = file.read(len(ZIP_MAGIC))
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if not head:
        raise CheckpointError(f"{path} is empty (truncated or corrupt)")
    if head != ZIP_MAGIC:
        raise CheckpointError(f"{path} is not a mok checkpoint (not a file torch.save writes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower():
            # torch's message advises weights_only=False, which would run the file's code.
            raise CheckpointError(f"{path} is not a mok checkpoint (it holds Python objects "
                                  "other than tensors and plain data)") from None
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(exc)})") from None
    except Exception as exc:  # torch reports damaged archives with several exception types
        raise CheckpointError(f"{path} is truncated or corrupt ({_first_line(exc)})") from None
    _check_checkpoint(path, state)
    return state


def _first_line(exc: BaseException, limit: int = 120) -> str:
    """The exception's type and first sentence, at most limit characters."""
    text = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_checkpoint(path: Path, state: object) -> None:
    """Raises CheckpointError unless state has the format marker (or, in checkpoints older
    than the marker, every key) and configs that this version of mok can build."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a mok checkpoint (it holds a "
                              f"{type(state).__name__}, not a dict)")
    marker = state.get("format")
    if marker is not None and marker != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a mok checkpoint (format {marker!r})")
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version!r}; this mok "
                              f"reads up to {CHECKPOINT_VERSION}")
    missing = [key for key in CHECKPOINT_KEYS if key not in state]
    if missing:
        keys = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise CheckpointError(f"{path} is an incomplete mok checkpoint (no {keys})" if marker else
                              f"{path} is not a mok checkpoint (a torch file without {keys})")
    try:
        ModelConfig(**state["model_config"])
        TrainConfig(**state["train_config"])
        valid = isinstance(state["step"], int) and state["step"] >= 0 \
            and state["backend"] in BACKENDS
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path} holds configs this mok cannot build "
                              f"({_first_line(exc)})") from None
    if not valid:
        raise CheckpointError(f"{path} holds an invalid step or backend")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """Training stopped on SIGINT or SIGTERM after a whole step.

    step is the number of steps done; checkpoint_path, when the run had one, holds them.
    """

    def __init__(self, signum: int, step: int, checkpoint_path: Path | None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step, self.checkpoint_path = signum, step, checkpoint_path

    @property
    def exit_code(self) -> int:
        """128 + the signal number: the status of a process the signal ended."""
        return 128 + self.signum


class StopRequest:
    """Signal handler that records the first SIGINT or SIGTERM in signum.

    A second signal restores the previous handlers and is raised again, so that it acts as if
    mok had not caught it (Ctrl-C twice stops at once, even in the middle of a step).
    """

    def __init__(self, previous: dict[int, Callable | int | None] | None = None) -> None:
        self.signum: int | None = None
        self.previous = previous or {}

    def __call__(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            return
        _restore_handlers(self.previous)
        signal.raise_signal(signum)


def _restore_handlers(handlers: dict[int, Callable | int | None]) -> None:
    for signum, handler in handlers.items():
        # None: a handler installed outside Python, which cannot be put back; the default is.
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, SIGINT and SIGTERM set the yielded request's signum instead of ending
    the process, for the caller to stop at a point of its choosing; the previous handlers come
    back on exit. Outside the main thread, where handlers cannot be installed, nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield StopRequest()
        return
    request = StopRequest({signum: signal.getsignal(signum) for signum in STOP_SIGNALS})
    for signum in STOP_SIGNALS:
        signal.signal(signum, request)
    try:
        yield request
    finally:
        _restore_handlers(request.previous)


def train_run(model_config: ModelConfig, train_config: TrainConfig, backend: str,
              device: torch.device, train_data: torch.Tensor, val_data: torch.Tensor,
              options: RunOptions, *, size: str = "custom", checkpoint_path: Path | None = None,
              resume: dict | None = None) -> RunResult:
    """Train one model from its seed (or from `resume`, a loaded checkpoint) to config.steps.

    SIGINT or SIGTERM stops it after the step in progress: that step is saved to checkpoint_path
    (when given) and Interrupted is raised.
    """
    model = build_model(model_config, backend, train_config.seed, device, options.hf_experts)
    optimizer = build_optimizer(model, train_config, device,
                                capturable=options.step_mode != "eager")
    start, losses, aux_losses = 0, [], []
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        start = resume["step"]
        losses, aux_losses = list(resume["losses"]), list(resume["aux_losses"])
        torch.set_rng_state(resume["rng_cpu"])
        if resume["rng_cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(resume["rng_cuda"])
    params_total, params_active = model.parameter_counts()
    stepper = Stepper(model, optimizer, train_config, device, options.step_mode)
    sampler = BatchSampler(train_data, train_config.batch_size, train_config.seq_len,
                           seed=train_config.seed, stream=0, device=device)
    steps_to_run = max(0, train_config.steps - start)
    # Per-step losses stay on the device; they are read only when logging (one sync per log).
    step_losses = torch.zeros(steps_to_run, device=device)
    step_aux = torch.zeros(steps_to_run, device=device)
    warmup = TIMING_WARMUP_STEPS if steps_to_run > TIMING_WARMUP_STEPS else 0
    timer_start: float | None = None
    paused = 0.0  # checkpoint writing inside the timed window, left out of tokens/s
    tokens = train_config.tokens_per_step
    bar = tqdm(range(start, train_config.steps), initial=start, total=train_config.steps,
               desc=f"train {backend}", unit="step", disable=not options.progress,
               dynamic_ncols=True)
    last_log_time, last_log_step = time.perf_counter(), start
    model.train()
    run_start = time.perf_counter()
    done = start
    with stop_on_signals() as stop:
        for step in bar:
            local = step - start
            if local == warmup:
                synchronize(device)
                timer_start = time.perf_counter()
            inputs, targets = sampler.batch(step)
            lr = train_config.lr * lr_multiplier(step, train_config)
            lm_loss, aux_loss = stepper(inputs, targets, lr=lr)
            step_losses[local] = lm_loss
            step_aux[local] = aux_loss
            done = step + 1
            if local == 0 or done % options.log_every == 0 or done == train_config.steps:
                loss_value, aux_value = torch.stack((lm_loss, aux_loss)).tolist()  # the one sync
                now = time.perf_counter()
                rate = tokens * (done - last_log_step) / max(now - last_log_time, 1e-9)
                last_log_time, last_log_step = now, done
                bar.set_postfix(loss=f"{loss_value:.4f}", tokens_per_s=f"{rate:,.0f}")
                tqdm.write(f"step {done:>6}/{train_config.steps}  loss {loss_value:.4f}  "
                           f"aux {aux_value:.4f}  lr {lr:.2e}  {rate:>12,.0f} tokens/s")
            if stop.signum is not None:
                break  # the checkpoint below saves this step
            if checkpoint_path is not None and done % options.checkpoint_every == 0 \
                    and done != train_config.steps:
                synchronize(device)  # the steps queued so far count as training, not saving
                saved = time.perf_counter()
                _save_checkpoint(checkpoint_path, model, optimizer, done,
                                 losses + step_losses[:local + 1].tolist(),
                                 aux_losses + step_aux[:local + 1].tolist(), model_config,
                                 train_config, backend, size, options.hf_experts,
                                 options.saved)
                paused += time.perf_counter() - saved
        bar.close()
        synchronize(device)
        end = time.perf_counter()
        losses += step_losses[:done - start].tolist()
        aux_losses += step_aux[:done - start].tolist()
        if checkpoint_path is not None:
            _save_checkpoint(checkpoint_path, model, optimizer, done, losses, aux_losses,
                             model_config, train_config, backend, size, options.hf_experts,
                             options.saved)
    if stop.signum is not None:
        raise Interrupted(stop.signum, done, checkpoint_path)
    timed_steps = steps_to_run - warmup
    tokens_per_s = (tokens * timed_steps / (end - timer_start - paused)
                    if timer_start is not None and timed_steps > 0 else None)
    val_sampler = BatchSampler(val_data, train_config.batch_size, train_config.seq_len,
                               seed=train_config.seed, stream=1, device=device)
    val_loss = evaluate(model, val_sampler, options.eval_batches, device)
    sample = None
    if options.sample_bytes:
        sample = generate(model, SAMPLE_PROMPT, options.sample_bytes, train_config.seq_len,
                          device, seed=train_config.seed)
    return RunResult(backend=backend, losses=losses, aux_losses=aux_losses, val_loss=val_loss,
                     tokens_per_s=tokens_per_s, timed_steps=max(timed_steps, 0),
                     train_seconds=end - run_start, params_total=params_total,
                     params_active=params_active, start_step=start, sample=sample,
                     step_mode=stepper.mode)


def plot_losses(path: Path, runs: list[RunResult]) -> None:
    """Training loss per step of each run (and its validation loss at the end), as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for run in runs:
        line, = axes.plot(range(1, len(run.losses) + 1), run.losses,
                          label=f"{run.backend} (train)", linewidth=1.2)
        axes.scatter([len(run.losses)], [run.val_loss], color=line.get_color(), marker="o",
                     zorder=3, label=f"{run.backend} validation {run.val_loss:.3f}")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy (nats per byte)")
    axes.set_title("MoE byte-level language model")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)


# -- command line ----------------------------------------------------------------------------

def int_at_least(minimum: int, multiple_of: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum (and a multiple of multiple_of)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value % multiple_of:
            raise argparse.ArgumentTypeError(f"must be a multiple of {multiple_of}, got {value}")
        return value

    return parse


def seed_value(text: str) -> int:
    """An argparse type: a seed in [0, 2**63)."""
    value = int_at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def device_name(text: str) -> str:
    """An argparse type: auto, or a CPU or CUDA device torch can parse (cpu, cuda, cuda:1)."""
    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options of `python -m mok train`; values out of range end in a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m mok train",
        description="Train a small mixture-of-experts byte-level language model (mok.nn.MoE in "
                    "every block) on the bundled public-domain corpus.",
        epilog="Ctrl-C or SIGTERM stops after the step in progress, saves OUT/checkpoint.pt and "
               "prints the command that resumes the run.")
    positive = int_at_least(1)
    parser.add_argument("--size", choices=("auto", *SIZES), default="auto",
                        help="model size: auto is small on CUDA (164M parameters, 32M active), "
                             "tiny on CPU; micro is one small layer; 1b is the training "
                             "benchmark's model (1.02B parameters, 77M active, 128 experts, "
                             "top-8)")
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                        help="experts implementation: auto is mok on CUDA and reference on CPU, "
                             "because on CPU mok's Triton kernels run under Triton's "
                             "interpreter, which takes seconds per layer and step (pass "
                             "--backend mok to run them anyway, e.g. with --size micro); hf is "
                             "Hugging Face's Qwen3MoeSparseMoeBlock on the same initial weights, "
                             "trained without auxiliary loss")
    parser.add_argument("--device", type=device_name, default="auto",
                        help="auto (CUDA if present), cpu or cuda")
    parser.add_argument("--steps", type=positive,
                        help="total steps (default: the size's; tiny 1000, small 200)")
    parser.add_argument("--schedule-steps", type=positive,
                        help="length of the warmup + cosine learning-rate schedule (default: "
                             "--steps); set it when the run will be continued with --resume")
    parser.add_argument("--warmup-steps", type=int_at_least(0),
                        help="learning-rate warmup (default: a tenth of the schedule, at most 100)")
    parser.add_argument("--batch-size", type=positive)
    parser.add_argument("--seq-len", type=positive)
    parser.add_argument("--lr", type=positive_float, help="peak learning rate")
    parser.add_argument("--seed", type=seed_value, help="seed of the initial weights and batches "
                                                        "(default: 0)")
    parser.add_argument("--out", default="runs/train", help="output folder (default: %(default)s)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/checkpoint.pt (model, optimizer, step, losses) to "
                             "--steps; the model and training settings are the checkpoint's")
    parser.add_argument("--checkpoint-every", type=positive, help="steps between checkpoints")
    parser.add_argument("--log-every", type=positive,
                        help="steps between printed losses (default: the size's, tiny 50 and "
                             "small 25, or an eighth of the run when that is fewer)")
    parser.add_argument("--eval-batches", type=positive, help="validation batches at the end")
    parser.add_argument("--sample-bytes", type=int_at_least(0),
                        help=f"bytes to generate at the end (0: none; default: {SAMPLE_BYTES})")
    parser.add_argument("--compare", action="store_true",
                        help="also train the hf backend from the same weights on the same "
                             "batches and report the speedup")
    parser.add_argument("--hf-experts", choices=HF_EXPERTS_IMPLEMENTATIONS,
                        default="grouped_mm",
                        help="transformers' experts implementation for the hf backend: "
                             "grouped_mm (the default of transformers 5 models) or eager (a "
                             "loop over experts)")
    parser.add_argument("--step-mode", choices=STEP_MODES, default="auto",
                        help="how a step runs: eager, graph (one CUDA graph a step), compile "
                        "(torch.compile, then a CUDA graph); auto: compile on CUDA, eager on CPU. "
                        "graph and compile fall back to eager where they cannot be set up")
    parser.add_argument("--corpus", help="train on this file's bytes instead of the bundled text")
    parser.add_argument("--threads", type=positive, help="CPU threads for torch")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file, not a folder")
    if args.corpus is not None:
        corpus = Path(args.corpus)
        if not corpus.exists():
            parser.error(f"--corpus {corpus}: no such file")
        if corpus.is_dir():
            parser.error(f"--corpus {corpus} is a folder, not a file")
        if corpus.stat().st_size == 0:
            parser.error(f"--corpus {corpus} is empty")
    if args.resume and args.compare:
        parser.error("--resume and --compare cannot be combined")
    return args


def minimum_corpus_bytes(seq_len: int, block_size: int = 1024, validation_every: int = 10) -> int:
    """The fewest bytes from which split_corpus gives both splits a window of seq_len + 1 bytes.

    The validation split is the one short of bytes: held-out block k starts after
    (validation_every - 1) * (k + 1) training blocks, so the window ends in the held-out block
    that reaches seq_len + 1 held-out bytes.
    """
    window = seq_len + 1
    full_blocks = (window - 1) // block_size  # held-out blocks filled before the last one
    return (validation_every - 1) * block_size * (full_blocks + 1) + window


def _configs_from_args(args: argparse.Namespace, preset: SizePreset,
                       steps: int) -> tuple[ModelConfig, TrainConfig]:
    schedule_steps = steps if args.schedule_steps is None else args.schedule_steps
    warmup = args.warmup_steps if args.warmup_steps is not None else \
        max(1, min(100, schedule_steps // 10))
    train_config = TrainConfig(
        steps=steps, schedule_steps=schedule_steps, warmup_steps=warmup,
        batch_size=preset.batch_size if args.batch_size is None else args.batch_size,
        seq_len=preset.seq_len if args.seq_len is None else args.seq_len,
        lr=preset.lr if args.lr is None else args.lr,
        seed=0 if args.seed is None else args.seed)
    return preset.model, train_config


def _fail(message: str) -> SystemExit:
    """The exit of `python -m mok train` with message as its one line on stderr."""
    return SystemExit(f"mok train: {message}")


def _configs_from_checkpoint(args: argparse.Namespace,
                             checkpoint: dict) -> tuple[ModelConfig, TrainConfig, str, str]:
    """The checkpoint's configs with steps from the command line; options that would change the
    run's trajectory may not differ from the checkpoint's."""
    model_config = ModelConfig(**checkpoint["model_config"])
    saved = TrainConfig(**checkpoint["train_config"])
    backend, size = checkpoint["backend"], checkpoint["size"]
    given = {"batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
             "schedule_steps": args.schedule_steps, "warmup_steps": args.warmup_steps,
             "seed": args.seed}
    for name, value in given.items():
        if value is not None and value != getattr(saved, name):
            raise _fail(f"--resume: --{name.replace('_', '-')} {value} differs from the "
                        f"checkpoint's {getattr(saved, name)}")
    if args.backend not in ("auto", backend):
        raise _fail(f"--resume: --backend {args.backend} differs from the checkpoint's {backend}")
    if args.size not in ("auto", size):
        raise _fail(f"--resume: --size {args.size} differs from the checkpoint's {size}")
    steps = args.steps if args.steps is not None else saved.steps
    if steps < checkpoint["step"]:
        raise _fail(f"--resume: --steps {steps} is before the checkpoint's step "
                    f"{checkpoint['step']}")
    return model_config, dataclasses.replace(saved, steps=steps), backend, size


def _prepare_out(out: Path, resume: bool) -> None:
    """Creates the output folder of a new run; checks that it can be written."""
    if not resume:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _fail(f"--out {out} cannot be created ({exc.strerror or exc})") from None
    if out.is_dir() and not os.access(out, os.W_OK | os.X_OK):
        raise _fail(f"--out {out} is not writable")


def _load_data(corpus: str | None, seq_len: int,
               expected_sha256: str | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(train, validation, sha256 of its bytes) of the corpus; exits when it cannot hold a
    window of seq_len + 1 bytes in each, or its bytes are not those of expected_sha256 (a
    resumed run's)."""
    try:
        data = load_corpus(corpus)
    except OSError as exc:
        raise _fail(f"--corpus {corpus} cannot be read ({exc.strerror or exc})") from None
    digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        source = f"--corpus {corpus}" if corpus is not None else "the bundled corpus"
        raise _fail(f"--resume: {source} holds other bytes than the corpus the checkpoint's run "
                    "trained on")
    needed = minimum_corpus_bytes(seq_len)
    if data.numel() < needed:
        source = f"--corpus {corpus}" if corpus is not None else "the bundled corpus"
        raise _fail(f"{source} holds {data.numel():,} bytes; --seq-len {seq_len} needs at least "
                    f"{needed:,} (a window of seq_len + 1 bytes for training and another in "
                    "the held-out tenth)")
    return (*split_corpus(data), digest)


def resume_command(args: argparse.Namespace) -> str:
    """The shell command that continues the run of args from its checkpoint."""
    words = ["python", "-m", "mok", "train", "--resume", "--out", args.out]
    if args.corpus is not None:
        words += ["--corpus", args.corpus]
    if args.device != "auto":
        words += ["--device", args.device]
    if args.step_mode != "auto":
        words += ["--step-mode", args.step_mode]
    return shlex.join(words)


def printable(data: bytes) -> str:
    """data as text: printable ASCII and newlines as they are, other bytes as \\xNN escapes."""
    return "".join(chr(b) if 32 <= b < 127 or b == 10 else f"\\x{b:02x}" for b in data)


def _format_rate(rate: float | None) -> str:
    return "n/a (too few steps)" if rate is None else f"{rate:,.0f}"


def main(argv: list[str] | None = None) -> dict:
    """Run `python -m mok train`; returns the summary written to OUT/summary.json.

    Invalid options end in SystemExit with a one-line message. SIGINT or SIGTERM during training
    saves the current step to OUT/checkpoint.pt, prints how to resume and ends in SystemExit
    with 128 + the signal number.
    """
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    out = Path(args.out)
    checkpoint_path = out / "checkpoint.pt"
    resume = None
    if args.resume:
        try:
            resume = load_checkpoint(checkpoint_path)
        except CheckpointError as exc:
            hint = " (start without --resume)" if not checkpoint_path.exists() else ""
            raise _fail(f"--resume: {exc}{hint}") from None
        model_config, train_config, backend, size = _configs_from_checkpoint(args, resume)
        preset = SIZES.get(size, SIZES["tiny"])
    else:
        size = resolve_size(args.size, device)
        preset = SIZES[size]
        backend = resolve_backend(args.backend, device)
        steps = args.steps if args.steps is not None else preset.steps
        model_config, train_config = _configs_from_args(args, preset, steps)
    if args.compare and backend == "hf":
        raise _fail("--compare trains the hf backend beside another one: pick mok or reference")
    hf_experts = resume["hf_experts"] if resume is not None else args.hf_experts
    try:
        step_mode = resolve_step_mode(args.step_mode, device)
    except ValueError as exc:
        raise _fail(f"--step-mode: {exc}") from None
    # A resumed run reads the corpus and the reporting options of its checkpoint unless given.
    saved = resume.get("settings", {}) if resume is not None else {}

    def option(name: str, default: int) -> int:
        value = getattr(args, name)
        return value if value is not None else saved.get(name, default)

    corpus = args.corpus if args.corpus is not None else saved.get("corpus")
    settings = dict(
        # Short runs log more often, so that a few dozen steps still show a curve.
        log_every=option("log_every", max(1, min(preset.log_every, train_config.steps // 8))),
        checkpoint_every=option("checkpoint_every", preset.checkpoint_every),
        eval_batches=option("eval_batches", preset.eval_batches),
        sample_bytes=option("sample_bytes", SAMPLE_BYTES))
    train_data, val_data, digest = _load_data(corpus, train_config.seq_len,
                                              saved.get("corpus_sha256"))
    options = RunOptions(
        **settings, hf_experts=hf_experts, progress=not args.no_progress, step_mode=step_mode,
        saved=dict(settings, corpus=str(Path(corpus).resolve()) if corpus is not None else None,
                   corpus_sha256=digest))
    _prepare_out(out, args.resume)  # last, so that a refused command leaves no folder behind

    if device.type == "cpu" and size in ("small", "1b"):
        print(f"mok train: warning: size {size} on the CPU takes minutes a step and "
              f"{'tens of' if size == '1b' else 'several'} GB of memory (sizes micro and tiny "
              "are the CPU's); a stop signal waits for the step in progress", file=sys.stderr)
    print(f"mok train: size {size}, backend {backend}, device {device}, step {step_mode}, "
          f"{train_config.steps} steps of {train_config.batch_size} x {train_config.seq_len} "
          f"bytes ({train_data.numel():,} training bytes, {val_data.numel():,} validation)")
    print(f"  model: {dataclasses.asdict(model_config)}")
    if resume is not None:
        print(f"  resuming from {checkpoint_path} at step {resume['step']}")
    try:
        run = train_run(model_config, train_config, backend, device, train_data, val_data,
                        options, size=size, checkpoint_path=checkpoint_path, resume=resume)
    except Interrupted as stopped:
        print(f"mok train: stopped by {signal.Signals(stopped.signum).name}; {checkpoint_path} "
              f"holds step {stopped.step} of {train_config.steps}; resume with: "
              f"{resume_command(args)}", file=sys.stderr)
        raise SystemExit(stopped.exit_code) from None
    runs = [run]
    print(f"{backend}: validation loss {run.val_loss:.4f}, "
          f"{_format_rate(run.tokens_per_s)} tokens/s ({run.timed_steps} timed steps)")
    if args.compare:
        hf_options = dataclasses.replace(options, sample_bytes=0)
        try:
            hf_run = train_run(model_config, train_config, "hf", device, train_data, val_data,
                               hf_options, size=size)
        except Interrupted as stopped:
            print(f"mok train: stopped by {signal.Signals(stopped.signum).name} at step "
                  f"{stopped.step} of the hf comparison run, which keeps no checkpoint; "
                  f"{checkpoint_path} holds the finished {backend} run", file=sys.stderr)
            raise SystemExit(stopped.exit_code) from None
        runs.append(hf_run)
        print(f"hf: validation loss {hf_run.val_loss:.4f}, "
              f"{_format_rate(hf_run.tokens_per_s)} tokens/s ({hf_run.timed_steps} timed steps)")

    summary = {
        "initial_loss": run.losses[0],
        "final_loss": run.losses[-1],
        "val_loss": run.val_loss,
        "tokens_per_s": run.tokens_per_s,
        "timed_steps": run.timed_steps,
        "train_seconds": run.train_seconds,
        "steps": train_config.steps,
        "resumed_from_step": run.start_step if resume is not None else None,
        "device": str(device),
        "backend": backend,
        "step_mode": run.step_mode,
        "size": size,
        "mok_commit": provenance.commit_id(),
        "params_total": run.params_total,
        "params_active": run.params_active,
        "tokens_per_step": train_config.tokens_per_step,
        "config": {"model": dataclasses.asdict(model_config),
                   "train": dataclasses.asdict(train_config),
                   "hf_experts": hf_experts if args.compare or backend == "hf" else None,
                   "corpus": options.saved["corpus"],
                   "corpus_sha256": options.saved["corpus_sha256"]},
        "losses": run.losses,
        "aux_losses": run.aux_losses,
        "sample": printable(run.sample) if run.sample is not None else None,
        "torch": torch.__version__,
    }
    if args.compare:
        hf_run = runs[1]
        speedup = (run.tokens_per_s / hf_run.tokens_per_s
                   if run.tokens_per_s and hf_run.tokens_per_s else None)
        summary["compare"] = {backend: run.brief(), "hf": hf_run.brief(), "speedup": speedup}
        print(f"tokens/s: {backend} {_format_rate(run.tokens_per_s)}, "
              f"hf {_format_rate(hf_run.tokens_per_s)}, speedup "
              + (f"{speedup:.2f}x" if speedup is not None else "n/a"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_losses(out / "loss.png", runs)
    print(f"loss: {run.losses[0]:.4f} -> {run.losses[-1]:.4f} (validation {run.val_loss:.4f})")
    if run.sample is not None:
        print(f"sample ({SAMPLE_TEMPERATURE} temperature, after {SAMPLE_PROMPT!r}):\n"
              f"{summary['sample']}")
    print(f"wrote {out / 'summary.json'}, {out / 'loss.png'}, {checkpoint_path}")
    return summary
