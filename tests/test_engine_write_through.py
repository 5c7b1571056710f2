"""The engine with a write-through tier: every block a step publishes is stored below when
the step ends, tokens stay equal to transformers', and a disk tier keeps a process's prefixes
even when the process ends without closing the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import test_engine_disk
from hybridkv.engine import LLMEngine, verify_completions
from test_engine_tiers import STATE, _reference, conversations

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(
    name: str,
    *,
    host: int | None = None,
    disk: Path | None = None,
    through: str | None = None,
    device: str = "cpu",
) -> LLMEngine:
    # test_engine_disk's: 24 blocks of 4 tokens per group, one 96-token request at a time
    return test_engine_disk._engine(name, disk, host, device=device, through=through)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_host_write_through_serves_the_same_hits_exactly(name: str) -> None:
    """The write-back workload of test_engine_tiers (five conversations that evict each other)
    with write-through: the same hits from host memory, the same tokens as transformers, and
    the host tier holds blocks the device never evicted."""
    turns = conversations(1, n_conv=5, turns=4, first=32, step=10)
    runs = {}
    for through in (None, "host"):
        engine = _engine(name, host=64 << 20, through=through)
        done = []
        for i, prompt in enumerate(turns):
            done += engine.generate({f"r{i}": prompt}, max_tokens=4)
        result = verify_completions(_reference(name), done)
        assert result.ok, result.mismatches
        engine.check_invariants()
        store = engine._tier_store
        assert store is not None
        tiers = engine.manager._coord.tiers
        assert tiers is not None
        assert store.host_keys() == tiers.tiers[0].entries()  # bytes for every entry
        runs[through] = (engine.stats(), engine.manager.tier_stats()["host"])
    (back, back_host), (through_stats, through_host) = runs[None], runs["host"]
    want = 600 if name in STATE else 620
    assert back.host_hit_tokens == through_stats.host_hit_tokens == want
    # write-through also stored what the device still caches at the end
    assert through_host["blocks"] > back_host["blocks"]
    assert through_host["stored"] > back_host["stored"]


_FIRST_PROCESS = """
import os, sys
sys.path[:0] = {paths!r}
from test_engine_write_through import _engine, TURNS
from pathlib import Path
engine = _engine({name!r}, disk=Path({disk!r}), through={through!r})
for i, prompt in enumerate(TURNS):
    engine.generate({{f"r{{i}}": prompt}}, max_tokens=4)
store = engine._tier_store
store.disk.flush()  # the writer thread's queue is on disk (the page cache)
os._exit(0)  # ends without close(): nothing is persisted at exit
"""

#: One conversation of two turns: it fits the device, so the device never evicts a block.
TURNS = conversations(3, n_conv=1, turns=2, first=40, step=12)


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_process_that_never_closes_leaves_its_prefixes_on_disk(name: str, tmp_path: Path) -> None:
    """A process serves a conversation that never leaves the device and exits without
    closing its engine.  With write-through to disk, a later engine on the directory serves
    the conversation's next turn from disk, exactly; with write-back alone nothing reached
    the disk and it misses."""
    hits = {}
    for through in (None, "disk"):
        d = tmp_path / str(through)
        code = _FIRST_PROCESS.format(
            paths=[str(Path(__file__).parent), *sys.path], name=name, disk=str(d), through=through
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
        engine = _engine(name, disk=d)
        nxt = TURNS[-1] + list(range(5, 15))
        done = engine.generate({"next": nxt}, max_tokens=4)
        result = verify_completions(_reference(name), done)
        assert result.ok, result.mismatches
        hits[through] = engine.stats().disk_hit_tokens
        engine.check_invariants()
        engine.close()
    assert hits[None] == 0
    # the second turn's prompt (52 tokens) and its 4 outputs were computed; the hit is
    # aligned to the block size (4) or, for the state model, to its checkpoints (8)
    assert hits["disk"] == (48 if name in STATE else 52)
