"""Thin launchers around the Triton kernels (no autograd, no API policy)."""

from mok.ops.comm import (
    PeerFlags,
    Pull,
    ScatterRows,
    SymmetricBuffer,
    scatter_route_values,
    signal_peers,
    wait_peers,
)
from mok.ops.experts import (
    combine,
    copy_rows,
    d_x_rows,
    down_bwd_dswiglu,
    down_proj,
    dswiglu_apart,
    gate_up_buffer,
    gate_up_swiglu,
    grouped_wgrad,
    grouped_wgrad_gate_up,
    router_grad,
)
from mok.ops.routing import (
    Routing,
    build_routing,
    capacity_rows,
    dense_routing,
    exchange_routes,
    local_first_blocks,
)
from mok.ops.tuning import GemmTiles, TileConfig, default_tiles, small_tiles

__all__ = [
    "GemmTiles",
    "PeerFlags",
    "Pull",
    "ScatterRows",
    "SymmetricBuffer",
    "Routing",
    "TileConfig",
    "build_routing",
    "capacity_rows",
    "combine",
    "copy_rows",
    "d_x_rows",
    "default_tiles",
    "dense_routing",
    "down_bwd_dswiglu",
    "down_proj",
    "dswiglu_apart",
    "exchange_routes",
    "gate_up_buffer",
    "gate_up_swiglu",
    "grouped_wgrad",
    "grouped_wgrad_gate_up",
    "local_first_blocks",
    "router_grad",
    "scatter_route_values",
    "signal_peers",
    "small_tiles",
    "wait_peers",
]
