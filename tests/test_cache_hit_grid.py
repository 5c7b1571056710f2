"""The learned hit grid: which grid junctions lie on, and the window tails it makes kept."""

from __future__ import annotations

import itertools
import random

from hypothesis import given
from hypothesis import strategies as hst

from hybridkv.cache import KVCacheManager
from hybridkv.cache.hit_grid import HALF_LIFE, MIN_JUNCTIONS, SHARE, HitGrid
from test_cache_factories import groups, run_to_completion, swa, tokens, uniform


def test_junctions_on_a_grid_make_it_the_grid() -> None:
    grid = HitGrid(16)
    for j in range(1, MIN_JUNCTIONS):
        grid.observe(512 * j)
    assert grid.grid() == 16  # too few junctions to trust anything coarser
    grid.observe(512 * MIN_JUNCTIONS)
    assert grid.grid() == 512  # half of them are multiples of 1024: not enough for that


def test_junctions_anywhere_leave_the_alignment() -> None:
    grid = HitGrid(16)
    rng = random.Random(0)
    for _ in range(500):
        grid.observe(16 * rng.randrange(1, 4000))
    assert grid.grid() == 16


def test_nothing_shared_and_unaligned_junctions_are_not_counted() -> None:
    grid = HitGrid(16)
    for _ in range(100):
        grid.observe(0)
        grid.observe(520)  # not a multiple of the alignment: not a junction of this cache
    assert (grid.total, grid.grid()) == (0.0, 16)


def test_a_grid_needs_nine_in_ten_junctions() -> None:
    grid = HitGrid(16)
    for i in range(100):  # 85% on the 512 grid, the rest on 32: the grid is 32
        grid.observe(512 * (i + 1) if i % 20 >= 3 else 32 * (2 * i + 1))
    assert grid.grid() == 32
    more = HitGrid(16)
    for i in range(100):  # 95% on the 512 grid
        more.observe(512 * (i + 1) if i % 20 else 32 * (2 * i + 1))
    assert more.grid() == 512


def test_the_grid_follows_a_change_of_workload() -> None:
    grid = HitGrid(16)
    for j in range(1, 200):
        grid.observe(512 * j)
    assert grid.grid() == 512
    rng = random.Random(1)
    for _ in range(3 * HALF_LIFE):  # then chats: junctions anywhere
        grid.observe(16 * rng.randrange(1, 4000))
    assert grid.grid() == 16


def _windowed(grid: int) -> KVCacheManager:
    """A 22-token prompt on a 4-token window (blocks of 4, alignment 4) computed and freed,
    after the hit grid saw ``grid``-token junctions (0: none)."""
    mgr = KVCacheManager(uniform(groups(swa(4)), 30))
    if grid:
        for j in range(1, 2 * MIN_JUNCTIONS):
            mgr._coord.hit_grid.observe(grid * j)
    run_to_completion(mgr, mgr.make_request("r0", tokens(22)), outputs=[1])
    mgr.check_invariants()
    return mgr


def test_a_window_is_kept_before_the_prompts_last_grid_point() -> None:
    # a later request shares the prompt up to 16 (its last point on an 8-token grid): the hit
    # there needs block 3 (tokens 12..16), which tail retention keeps only with the grid
    # (instead of the window before the prompt's end, 20: block 4, which no later request on
    # the grid would read)
    sharer = [*tokens(16), 90, 91, 92, 93, 94]
    mgr = _windowed(8)
    assert mgr._coord.hit_grid.grid() == 8
    assert mgr.get_computed_blocks(mgr.make_request("s", sharer)).num_computed_tokens == 16
    plain = _windowed(0)
    assert plain.get_computed_blocks(plain.make_request("s", sharer)).num_computed_tokens == 0
    # a resend still hits 20: the window before the computed end is kept when it is freed
    for m in (mgr, plain):
        assert m.get_computed_blocks(m.make_request("re", tokens(22))).num_computed_tokens == 20


def test_admissions_teach_the_grid() -> None:
    mgr = KVCacheManager(uniform(groups(swa(4)), 60))
    base = tokens(8)
    run_to_completion(mgr, mgr.make_request("first", base), outputs=[1])
    for i in range(MIN_JUNCTIONS):  # every request shares the 8-token prefix, then diverges
        run_to_completion(mgr, mgr.make_request(f"r{i}", [*base, 100 + i, 7, 7]), outputs=[1])
    assert mgr._coord.hit_grid.total == MIN_JUNCTIONS
    assert mgr._coord.hit_grid.grid() == 8
    mgr.check_invariants()


@given(
    alignment=hst.sampled_from([1, 4, 16, 256]),
    junctions=hst.lists(hst.integers(0, 1 << 20), max_size=300),
)
def test_counts_stay_nested_and_the_grid_a_level_after_every_junction(
    alignment: int, junctions: list[int]
) -> None:
    grid = HitGrid(alignment)
    for j in junctions:
        grid.observe(j - j % alignment if j % 3 else j)  # mostly aligned, some not
        counts = grid.counts
        assert all(a >= b for a, b in itertools.pairwise(counts))
        assert counts[0] == grid.total  # every counted junction is a multiple of the alignment
        g = grid.grid()
        assert g % alignment == 0 and (g // alignment) & (g // alignment - 1) == 0
        k = (g // alignment).bit_length() - 1
        assert k == 0 or (grid.total >= MIN_JUNCTIONS and counts[k] >= SHARE * grid.total)
