"""scripts/moe_schedule_model.py, the model behind docs/decisions.md's figures for the
persistent MoE kernel's work orders: its items, and the orders' loads on a routing where
narrow tiles are many (GPT-OSS-120B's whole layer at M=4096)."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import moe_schedule_model as model  # noqa: E402

sys.path.remove(str(SCRIPTS))


def test_items_skip_narrow_tiles_and_turn_blocks_where_the_grid_pins_them():
    # 12 blocks on 132 SMs turn by the tile's ordinal: the third tile's last block (a quarter
    # real) is its tenth item.
    work = model.items([128, 20, 128], blocks=12, padded_last=True)
    assert len(work) == 36 and work[12:24] == [0.0] * 12
    assert work[11] == 0.6 and work[24 + 9] == 0.6 and work.count(0.6) == 2
    # 23 blocks do not; a 64-token tile costs its fitted width.
    assert model.items([64], blocks=23, padded_last=False) == [0.6] * 23


def test_the_listed_orders_balance_what_skipping_in_place_does_not():
    tiles = model.tiles_of(4096, 128, 128)
    assert sum(len(t) for t in tiles) > 128  # experts past one tile, their last ones narrow
    loads = model.loads(tiles, blocks=23, padded_last=True)
    assert loads["mean"] <= min(loads["listed"], loads["widest first"], loads["counter"])
    assert loads["listed"] < 0.9 * loads["skipped"]
    assert loads["widest first"] <= loads["listed"]
