"""The host tier's byte slots (hybridkv.engine.host_slots): a batch of takes gives exactly
the slots the same takes one by one would, the slots stay disjoint, and space one size freed
serves another."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.engine.host_slots import HostSlots

SIZES = (48, 96, 160)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["take", "give"]), st.sampled_from(SIZES), st.integers(1, 6)),
        max_size=30,
    )
)
def test_take_many_equals_takes_one_by_one(steps: list[tuple[str, int, int]]) -> None:
    slots = HostSlots(2000, pin=False)
    held: list[tuple[int, int]] = []
    for what, size, count in steps:
        if what == "give":
            for offset, s in held[:count]:
                slots.give(offset, s)
            del held[:count]
        else:
            before = copy.deepcopy(slots.space)
            want = [slots.take(size) for _ in range(count)]
            after = slots.space.extents(), slots.top
            slots.space = before
            assert slots.take_many(size, count) == want
            assert (slots.space.extents(), slots.top) == after
            held += [(o, size) for o in want if o >= 0]
        slots.check([(o, s, f"slot {o}") for o, s in held])


def test_space_freed_by_small_slots_serves_large_ones() -> None:
    # Found by review: free lists per exact size left a buffer emptied of 176 B slots unable
    # to hold one 512 B slot, and the tier stored those in tensors of their own (1.99x the
    # host budget).
    slots = HostSlots(4096, pin=False)
    small = [slots.take(176) for _ in range(23)]
    assert -1 not in small and slots.take(512) == -1
    for offset in small:
        slots.give(offset, 176)
    assert slots.top == 0 and slots.space.free_bytes == 0
    assert [slots.take(512) for _ in range(8)] == [512 * i for i in range(8)]
    slots.check([(512 * i, 512, "large") for i in range(8)])
