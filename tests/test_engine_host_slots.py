"""The host tier's byte slots (hybridkv.engine.host_slots): a batch of takes gives exactly
the slots the same takes one by one would, and the slots stay disjoint."""

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
            one_by_one = copy.deepcopy(slots.free), slots.top
            want = [slots.take(size) for _ in range(count)]
            free_after, top_after = copy.deepcopy(slots.free), slots.top
            slots.free, slots.top = one_by_one
            assert slots.take_many(size, count) == want
            assert (slots.free, slots.top) == (free_after, top_after)
            held += [(o, size) for o in want if o >= 0]
        slots.check([(o, s, f"slot {o}") for o, s in held])
