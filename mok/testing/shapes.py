"""The benchmark shapes of docs/design.md section 4 (per GPU)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    topk: int
    num_tokens: int
    shared_intermediate_size: int = 0

    def flops(self, backward: bool = True) -> float:
        """Counted FLOPs: forward 6*T*k*H*I (+ 6*T*H*I_s); forward+backward three times that."""
        forward = 6.0 * self.num_tokens * self.hidden_size * (
            self.topk * self.intermediate_size + self.shared_intermediate_size)
        return 3.0 * forward if backward else forward


SHAPES = (
    MoEShape("qwen3-30b-a3b", 128, 2048, 768, 8, 16384),
    MoEShape("olmoe-1b-7b", 64, 2048, 1024, 8, 16384),
    MoEShape("mixtral-8x7b", 8, 4096, 14336, 2, 8192),
    MoEShape("deepseek-v2-lite", 64, 2048, 1408, 6, 16384, 2816),
    MoEShape("kimi-ep64-slice", 6, 7168, 2048, 2, 8192),
)

# Shapes outside the tile table (the tile rule's, mok.ops.tuning.RULES), from public configs:
# SonicMoE's two benchmark shapes (arXiv 2512.14080), the training job's small model
# (python -m mok train), and MoE layers of released models (hidden, moe intermediate, experts,
# top-k as their configs give them; tokens a training microbatch's).
UNTUNED_SHAPES = (
    MoEShape("sonicmoe-7b", 128, 1536, 256, 8, 24576),
    MoEShape("sonicmoe-30b", 128, 4096, 512, 8, 32768),
    MoEShape("mok-small", 32, 768, 256, 4, 16384),
    MoEShape("granite-3.0-1b-a400m", 32, 1024, 512, 8, 16384),
    MoEShape("qwen3-next-80b-a3b", 512, 2048, 512, 10, 16384, 512),
    MoEShape("qwen3-235b-a22b", 128, 4096, 1536, 8, 16384),
    MoEShape("gpt-oss-20b", 32, 2880, 2880, 4, 16384),
    MoEShape("phi-3.5-moe", 16, 4096, 6400, 2, 16384),
    MoEShape("llama4-scout", 16, 5120, 8192, 1, 8192, 8192),
)

SHAPES_BY_NAME = {shape.name: shape for shape in (*SHAPES, *UNTUNED_SHAPES)}
