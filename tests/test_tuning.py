"""The committed tile table: complete for the benchmark shapes, usable as it stands, stable."""

import dataclasses
import json

import pytest

from mok import _env
from mok.ops.tuning import (
    HOPPER_TILES,
    KINDS,
    TUNED_TILES_PATH,
    GemmTiles,
    table_to_json,
)
from mok.testing import SHAPES

# (n, k) of each kind for the routed experts (mok.ops.tuning.KINDS).
KEYS = {"gate_up": "IH", "down": "HI", "down_bwd": "IH", "down_bwd_saved": "IH", "d_x": "HI",
        "wgrad_gate_up": "IH", "wgrad_down": "HI"}


def committed() -> dict:
    return {(kind, int(key.split(",")[0]), int(key.split(",")[1])): GemmTiles(**fields)
            for kind, entries in json.loads(TUNED_TILES_PATH.read_text()).items()
            for key, fields in entries.items()}


def test_every_kind_is_keyed():
    assert set(KEYS) == set(KINDS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_benchmark_shape_has_measured_tiles_that_are_used(shape):
    table = committed()
    sizes = {"H": shape.hidden_size, "I": shape.intermediate_size}
    for kind, (n, k) in KEYS.items():
        key = (kind, sizes[n], sizes[k])
        assert key in table, f"{key} not tuned: the layer would fall back to the defaults"
        tiles = table[key]
        # pick() only takes a row tile that divides the schedule's alignment
        if not kind.startswith("wgrad"):
            assert HOPPER_TILES.align % tiles.block_m == 0, key
        assert min(tiles.block_m, tiles.block_n, tiles.block_k) >= 16, key
        if not _env.TILES_FILE:  # MOK_TILES_FILE names another table: this file alone counts
            assert HOPPER_TILES.pick(*key) == tiles


def test_table_file_is_what_table_to_json_writes():
    # So `benchmarks.tune` rewriting the table changes only the entries it measured.
    assert table_to_json(committed()) == TUNED_TILES_PATH.read_text()


def test_pick_falls_back_to_the_config_tiles():
    assert HOPPER_TILES.pick("d_x", 12345, 678) == HOPPER_TILES.d_x
    assert HOPPER_TILES.pick("wgrad_down", 12345, 678) == HOPPER_TILES.wgrad
    assert HOPPER_TILES.pick("down_bwd_saved", 12345, 678) == HOPPER_TILES.down
    untuned = dataclasses.replace(HOPPER_TILES, use_tuned=False)
    shape = SHAPES[0]
    assert untuned.pick("gate_up", shape.intermediate_size, shape.hidden_size) == untuned.gate_up
