"""hybridkv.extents.FreeExtents: exact ids for the three ways a take is served, joins on
give, and a random-operation state machine checked after every step against a byte map."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybridkv.extents import FreeExtents


def test_exact_size_then_a_split_then_the_bump_mark() -> None:
    space = FreeExtents(1000, min_rest=50, lower_top=False)
    a, b, c, d = (space.take(n) for n in (100, 300, 100, 200))
    assert (a, b, c, d) == ((0, None), (100, None), (400, None), (500, None))
    assert space.give(100, 300) == (100, 300)
    assert space.give(500, 200) == (500, 200)
    assert space.take(300) == (100, None)  # the same size first
    space.give(100, 300)
    assert space.take(150) == (500, (650, 50))  # then a split of the smallest that fits
    assert space.take(280) == (700, None)  # 300 - 280 < min_rest: the bump mark
    assert space.take(260) is None  # nothing left has room
    assert space.take(50) == (650, None)
    assert space.take(200) == (100, (300, 100))


def test_give_joins_both_neighbours_and_lowers_the_mark() -> None:
    space = FreeExtents(1000)
    for n in (100, 100, 100, 100):
        space.take(n)
    assert space.give(0, 100) == (0, 100)
    assert space.give(200, 100) == (200, 100)
    assert space.give(100, 100) == (0, 300)  # joins both sides
    assert space.give(300, 100) == (0, 0)  # the whole carved space: the mark drops to 0
    assert space.top == 0 and space.extents() == []
    disk = FreeExtents(1000, lower_top=False)
    disk.take(100)
    assert disk.give(0, 100) == (0, 100) and disk.top == 100


class ExtentsMachine(RuleBasedStateMachine):
    """Takes and gives of a few sizes; a byte map says who holds what."""

    def __init__(self) -> None:
        super().__init__()
        self.space = FreeExtents(2048, min_rest=64, lower_top=False)
        self.held: dict[int, int] = {}

    @rule(n=st.sampled_from([64, 128, 192, 448]), lower=st.booleans())
    def take(self, n: int, lower: bool) -> None:
        free = self.space.extents()
        got = self.space.take(n)
        fits = [k for _, k in free if k == n or k - n >= 64]
        if got is None:
            assert not fits and self.space.limit - self.space.top < n
            return
        start, rest = got
        assert start not in self.held
        if n in fits:  # an extent of the size itself first
            assert (start, n) in free and rest is None
        elif fits:  # else a split of the smallest that fits
            assert (start, n + rest[1]) in free and rest == (start + n, rest[1])  # type: ignore[index]
            assert rest[1] == min(fits) - n  # type: ignore[index]
        else:  # else the bump mark
            assert rest is None and start + n == self.space.top
        self.held[start] = n

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def give(self, i: int) -> None:
        start = sorted(self.held)[i % len(self.held)]
        n = self.held.pop(start)
        s, length = self.space.give(start, n)
        assert s <= start and start + n <= s + length

    @invariant()
    def consistent(self) -> None:
        self.space.check([(s, n, f"slot {s}") for s, n in self.held.items()])
        covered = sum(self.held.values()) + self.space.free_bytes
        assert covered == self.space.top  # every carved byte is held or free


TestExtents = ExtentsMachine.TestCase
TestExtents.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
