"""The simulator's summary table: the per-group cell stays short for split state groups."""

from __future__ import annotations

from hybridkv.sim.report import compact_groups


def test_equal_neighbouring_groups_share_an_entry() -> None:
    rates = {
        "g0:state, 9 layers": 0.521,
        "g1:state, 9 layers": 0.521,
        "g2:state, 9 layers": 0.521,
        "g3:state, 9 layers": 0.521,
        "g4:full_attention, 12 layers": 0.604,
    }
    assert compact_groups(rates) == (
        "g0-g3:state, 4x9 layers 52.1%, g4:full_attention, 12 layers 60.4%"
    )


def test_groups_that_differ_stay_apart() -> None:
    rates = {
        "g0:sliding_window(128), 12 layers": 0.015,
        "g1:sliding_window(128), 12 layers": 0.016,  # another rate
        "g2:full_attention, 1 layer": 0.5,
        "g3:full_attention, 2 layers": 0.5,  # another size
        "g5:full_attention, 2 layers": 0.5,  # not the next group
        "something else": 0.25,
    }
    assert compact_groups(rates) == (
        "g0:sliding_window(128), 12 layers 1.5%, g1:sliding_window(128), 12 layers 1.6%, "
        "g2:full_attention, 1 layer 50.0%, g3:full_attention, 2 layers 50.0%, "
        "g5:full_attention, 2 layers 50.0%, something else 25.0%"
    )
