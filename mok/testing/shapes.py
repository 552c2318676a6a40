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

SHAPES_BY_NAME = {shape.name: shape for shape in SHAPES}
