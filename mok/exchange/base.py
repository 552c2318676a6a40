"""The exchange protocol: how token rows reach the experts and their outputs come back.

One object per mode owns the order of its phases; mok.functional calls every mode the same way,
in the order the data flows:

    schedule      build_schedule            the routing of the experts' rows (and the plan of
                                            the exchange: what moves where)
    tokens in     tokens                    the tokens this layer's experts see (across nodes:
                                            gathered from the other nodes)
    rows in       forward_rows /            the rows the first GEMM reads, and the pull or copy
                  backward_rows             that brings them (None: they are here)
                  forward_rows_fp8 /        (MoKConfig precision "fp8") the same rows, landed
                  backward_rows_fp8         before the GEMMs, the forward's as e4m3
                  rows_read                 after the launch that read them
    rows out      scatter                   where the last GEMM writes its rows (None: here)
                  send_route_values         the router-weight gradients, to their tokens' ranks
                  deliveries_done, landed   this rank's deliveries are out; everyone's are in
    combine       combine, route_values     each token's output (and router-weight gradient)

`config` arguments are the layer call's mok.functional.MoKConfig. Legend: T tokens of this rank,
H hidden, k experts per token, C schedule rows, P ranks, T_max the most tokens a rank passes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from mok.ops import Pull, Quantized, Routing, ScatterRows


class Phase(enum.IntEnum):
    """The exchange's phases; each is numbered on the device, identically on every rank."""

    SCHEDULE = 0
    FORWARD = 1
    BACKWARD = 2
    DELIVERY = 3  # the ring's rounds of rows going back to their tokens' ranks


NUM_PHASES = len(Phase)


class Movement(enum.Enum):
    """How the first GEMM of a phase gets rows that live on other ranks."""

    HERE = "here"        # every row is on this rank already
    PULLED = "pulled"    # the GEMM's launch pulls them (its tiles wait on them)
    COPIED = "copied"    # copies beside the launch move them (its tiles wait on them)


@dataclass(frozen=True)
class ForwardRows:
    """What the forward's gate/up GEMM reads.

    x: token rows [T or P * T_max, H]; route_weights: the router weights the down GEMM scales
    rows by ([T, k], or by route of the group [P * T_max * k]); pull: how x's rows arrive (None:
    here); kept_weights: the route weights the forward context keeps (None: the backward gets the
    router weights again from its caller).
    """

    x: torch.Tensor
    route_weights: torch.Tensor
    pull: Pull | None = None
    kept_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class Fp8ForwardRows:
    """What the FP8 forward's gate/up GEMM reads: x, the token rows in e4m3 with their 1 x 128
    scales (mok.ops.quantize_rows), landed ([T, H], or the group's [P * T_max, H]);
    route_weights and kept_weights as ForwardRows'."""

    x: Quantized
    route_weights: torch.Tensor
    kept_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class BackwardRows:
    """What the backward's GEMMs read: d_output and x rows (the FP8 backward's with
    fp8_weight_gradients in e4m3), the pull of the first GEMM's launch and x_pull, a pull run by
    the d_x launch for the weight gradients alone (None: none)."""

    d_output: torch.Tensor | Quantized
    x: torch.Tensor | Quantized
    pull: Pull | None = None
    x_pull: Pull | None = None


def route_capacity(num_routes: int, num_ranks: int, multiplier: float) -> int:
    """Schedule rows for num_routes routes of each of num_ranks ranks: multiplier * num_routes,
    never more than can arrive."""
    return min(num_routes * num_ranks, math.ceil(multiplier * num_routes))


class Exchange:
    """The protocol (see the module docstring). Subclasses: LocalExchange (one GPU),
    SymmetricExchange (the ranks of a node, symmetric memory), CrossNodeExchange (nodes)."""

    num_ranks: int = 1
    rank: int = 0

    @property
    def rows_here(self) -> bool:
        """Whether the rows the last GEMM writes stay on this rank (combine needs no wait)."""
        raise NotImplementedError

    @property
    def delivers_in_combine(self) -> bool:
        """Whether `combine` itself moves the last GEMM's rows to their tokens' ranks (they stay
        here until then): the backward then combines d_x before the weight gradients, which
        frees its rows [C, H] first."""
        return self.rows_here

    def group_rank(self, peer: int) -> int:
        """The group's rank of `peer`, a rank of the flags' group (the node's, across nodes)."""
        return peer

    def movement(self, phase: Phase, config) -> Movement:
        raise NotImplementedError

    def build_schedule(self, topk_experts: torch.Tensor, *, config, num_local_experts: int,
                       align: int) -> tuple[Routing, object]:
        """(routing of this rank's expert rows, the exchange's plan for this schedule)."""
        raise NotImplementedError

    def tokens(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tokens this rank's experts see, for each [T, ...] tensor."""
        raise NotImplementedError

    def forward_rows(self, plan, x: torch.Tensor, router_weights: torch.Tensor, *, config,
                     block_m: int) -> ForwardRows:
        raise NotImplementedError

    def backward_rows(self, plan, d_output: torch.Tensor, x: torch.Tensor, *, config,
                      block_m: int, kept: bool, apart: bool) -> BackwardRows:
        """kept: the forward kept its pre-activations (x is read by the weight gradients alone);
        apart: the first launch recomputes gate/up on its own (it reads x first)."""
        raise NotImplementedError

    def forward_rows_fp8(self, plan, x: torch.Tensor, xq: Quantized | None,
                         router_weights: torch.Tensor, *, config) -> Fp8ForwardRows:
        """The FP8 forward's rows, landed and read (no `rows_read` after): x's tokens quantized
        (xq: quantize_rows(x) where the caller has it, else quantized here)."""
        raise NotImplementedError

    def backward_rows_fp8(self, plan, d_output: torch.Tensor, x: torch.Tensor, *, config,
                          dq: Quantized | None = None, xq: Quantized | None = None
                          ) -> BackwardRows:
        """The FP8 backward's rows, landed and read (no `rows_read` after); no pulls. d_output
        and x in their dtype (the bf16 weight gradients read them so), or with
        config.fp8_weight_gradients in e4m3 with their 1 x 128 scales (dq, xq: quantize_rows of
        d_output and x where the caller has them, else quantized here)."""
        raise NotImplementedError

    def rows_read(self, phase: Phase) -> None:
        raise NotImplementedError

    def scatter(self, plan, dtype: torch.dtype) -> ScatterRows | None:
        raise NotImplementedError

    def send_route_values(self, plan, by_route: torch.Tensor) -> None:
        raise NotImplementedError

    def deliveries_done(self, plan, phase: Phase, dtype: torch.dtype, *, values: bool,
                        wait: bool) -> None:
        """This rank delivered its rows (values: and route values) of the phase; wait: also
        wait for every rank's (else call `landed` later)."""
        raise NotImplementedError

    def landed(self, phase: Phase) -> None:
        raise NotImplementedError

    def combine(self, plan, rows: torch.Tensor, routing: Routing,
                shared_rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """out [T, H] in dtype: the shared expert's rows plus each token's routed rows."""
        raise NotImplementedError

    def route_values(self, plan, by_route: torch.Tensor) -> torch.Tensor:
        """d_router_weights [T, k] fp32 of this rank's tokens."""
        raise NotImplementedError
