"""The engine over a disk tier: prefixes come back from disk exactly, a later engine (or
process) on the same directory reuses them, and every kind of damage ends in a miss with the
same tokens."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli.main import main
from hybridkv.engine import CacheConfig, LLMEngine, verify_completions
from hybridkv.engine.disk_tier import DiskTier
from hybridkv.engine.errors import EngineError
from hybridkv.engine.tier_store import TierStore
from hybridkv.errors import PlanError
from hybridkv.storage import StorageAllocationError
from hybridkv.storage.disk_slots import HEADER_BYTES, DiskCacheError
from test_engine_tiers import MODELS, STATE, _reference, conversations

pytestmark = pytest.mark.usefixtures("one_thread")

TURNS = conversations(1, n_conv=5, turns=4, first=32, step=10)


def _cache(disk: Path | None, host: int | None = None, through: str | None = None) -> CacheConfig:
    # 24 blocks of 4 tokens per group: one 96-token request; five conversations do not fit.
    return CacheConfig(
        strategy="pools",
        block_size=4,
        state_block_size=8,
        num_blocks=24,
        max_model_len=96,
        host_memory_bytes=host,
        disk_cache_dir=disk,
        disk_memory_bytes=None if disk is None else 64 << 20,
        write_through=through,
    )


def _engine(
    name: str,
    disk: Path | None,
    host: int | None = None,
    device: str = "cpu",
    through: str | None = None,
) -> LLMEngine:
    return LLMEngine(name, cache=_cache(disk, host, through), keep_logits=True, device=device)


def _serve(engine: LLMEngine, turns: list[list[int]] = TURNS) -> list[Any]:
    done = []
    for i, prompt in enumerate(turns):
        done += engine.generate({f"r{i}": prompt}, max_tokens=4)  # one request at a time
    return done


def _exact(name: str, done: list[Any]) -> None:
    result = verify_completions(_reference(name), done)
    assert result.ok, result.mismatches


@pytest.mark.parametrize("name", MODELS)
def test_prefixes_come_back_from_disk_and_from_a_later_engine(name: str, tmp_path: Path) -> None:
    engine = _engine(name, tmp_path)
    _exact(name, _serve(engine))
    stats = engine.stats()
    # Every hit comes back from disk (no host tier): the same hits as from host memory.
    want = {"lfm2": 592}.get(name, 600 if name in STATE else 620)
    assert stats.prefix_hit_tokens == stats.disk_hit_tokens == want
    assert stats.disk_hit_tokens / stats.prompt_tokens >= 0.5
    engine.check_invariants()
    store = engine._tier_store
    assert store is not None and store.disk is not None and store.bad_reads == 0
    tiers = engine.manager._coord.tiers
    assert tiers is not None
    store.disk.flush()  # the writer thread's queue
    assert set(store.disk.slots.entries) == {
        (g, h) for g, keys in enumerate(tiers.tiers[0].keys) for h in keys
    }
    evicted = engine.manager.tier_stats()["disk"]["blocks"]
    engine.close()  # writes what the device still caches to disk too
    disk = engine.manager.tier_stats()["disk"]
    assert disk["blocks"] > evicted
    # A new engine (host tier above this time) adopts what the first left: the first turn of
    # every conversation now hits too, read from disk.
    again = _engine(name, tmp_path, host=1 << 20)
    assert again.manager.tier_stats()["disk"]["adopted"] == disk["blocks"]
    _exact(name, _serve(again))
    st = again.stats()
    assert st.disk_hit_tokens > 0 and st.prefix_hit_tokens > want
    assert st.prefix_hit_tokens == st.disk_hit_tokens + st.host_hit_tokens
    again.check_invariants()
    again.close()


def _first_run(name: str, d: Path) -> int:
    """Fill ``d`` with a clean run; returns its number of disk entries."""
    engine = _engine(name, d)
    _serve(engine)
    engine.close()
    return engine.manager.tier_stats()["disk"]["blocks"]


def _rerun(name: str, d: Path) -> tuple[LLMEngine, TierStore]:
    engine = _engine(name, d)
    _exact(name, _serve(engine))
    engine.check_invariants()
    store = engine._tier_store
    assert store is not None
    engine.close()
    return engine, store


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_flipped_bytes_are_misses(name: str, tmp_path: Path) -> None:
    clean_dir, bad_dir = tmp_path / "clean", tmp_path / "bad"
    _first_run(name, clean_dir)
    clean, _ = _rerun(name, clean_dir)
    _first_run(name, bad_dir)
    # flip one payload byte of every other committed slot, found by walking the file
    data = (bad_dir / "blocks.bin").read_bytes()
    offsets = _committed_offsets(data)
    with (bad_dir / "blocks.bin").open("r+b") as f:
        for off in offsets[::2]:
            f.seek(off + HEADER_BYTES + 3)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x01]))
    engine, store = _rerun(name, bad_dir)
    assert store.bad_reads > 0
    assert engine.manager.tier_stats()["disk"]["discarded"] == store.bad_reads
    assert engine.stats().disk_hit_tokens < clean.stats().disk_hit_tokens


def _committed_offsets(data: bytes) -> list[int]:
    from hybridkv.storage.disk_format import parse_header as _parse
    from hybridkv.storage.disk_format import slot_stride as _stride

    out, off = [], 0
    while off + HEADER_BYTES <= len(data):
        parsed = _parse(data[off : off + 128])
        if parsed is None:
            break
        if parsed[2] == 1:
            out.append(off)
        off += _stride(parsed[1])
    return out


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_flipped_checksum_and_a_truncated_file_are_misses(name: str, tmp_path: Path) -> None:
    n = _first_run(name, tmp_path)
    data = (tmp_path / "blocks.bin").read_bytes()
    offsets = _committed_offsets(data)
    assert len(offsets) == n
    crc_at = 8 + 8 + 4 + 4 + 8 + 8  # the payload CRC inside the header
    with (tmp_path / "blocks.bin").open("r+b") as f:
        f.seek(offsets[1] + crc_at)
        f.write(bytes([data[offsets[1] + crc_at] ^ 0x10]))
    os.truncate(tmp_path / "blocks.bin", offsets[n // 2] + HEADER_BYTES + 5)
    engine, _ = _rerun(name, tmp_path)
    # the walk steps over the torn header's slot and ends at the cut: entry 1 is lost,
    # entry n // 2 is adopted by its whole header (its payload, cut short, is then a miss)
    assert engine.manager.tier_stats()["disk"]["adopted"] == n // 2


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_failed_writes_are_misses(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.pwritev
    count = [0]
    lock = threading.Lock()

    def flaky(fd: int, views: Any, offset: int) -> int:
        with lock:  # an entry's write (header and payload): every third one fails
            count[0] += 1
            if count[0] % 3 == 0:
                raise OSError(5, "Input/output error")
        return real(fd, views, offset)

    monkeypatch.setattr(os, "pwritev", flaky)
    engine = _engine(name, tmp_path)
    _exact(name, _serve(engine))
    store = engine._tier_store
    assert store is not None and store.disk is not None
    store.disk.flush()
    assert store.disk.slots.write_errors > 0 and store.bad_reads > 0
    stats = engine.stats()
    assert 0 < stats.disk_hit_tokens < {"qwen3_next": 600}.get(name, 620)
    engine.check_invariants()
    engine.close()


_KILLER = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_engine_disk import _engine, _serve
from hybridkv.storage.disk_slots import HEADER_BYTES, DiskSlots
real, many = os.pwritev, DiskSlots.write_many
calls = [0]
def dies(fd, views, offset):
    calls[0] += 1
    if calls[0] == {at}:  # header and half the payload reach the file, then the kill
        data = b"".join(bytes(v) for v in views)
        os.pwrite(fd, data[: HEADER_BYTES + (len(data) - HEADER_BYTES) // 2], offset)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, views, offset)
os.pwritev = dies
# one thread: the entries go out in slot order (two threads may leave a hole before the
# torn slot, which ends the walk: test_storage_disk_slots covers that)
DiskSlots.write_many = lambda self, items, helper=None: many(self, items, None)
import torch
torch.set_num_threads(1)
_serve(_engine({name!r}, {d!r}))
"""


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_process_killed_mid_write_leaves_a_usable_directory(name: str, tmp_path: Path) -> None:
    tests = str(Path(__file__).parent)
    # killed in the middle of the seventh entry's write (its header is out, half its payload)
    script = _KILLER.format(tests=tests, name=name, d=str(tmp_path), at=7)
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    engine, store = _rerun(name, tmp_path)  # tokens identical to transformers
    adopted = engine.manager.tier_stats()["disk"]["adopted"]
    # the six entries written whole, and the seventh by its header: its payload checksum
    # fails when the rerun reads it, and the block is computed again
    assert adopted == 7
    assert store.bad_reads == 1
    assert engine.stats().disk_hit_tokens > 0


def test_a_request_waiting_for_disk_does_not_hold_up_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _first_run("llama", tmp_path)
    engine = _engine("llama", tmp_path)
    gate = threading.Event()
    real = DiskTier._read

    def slow(self: DiskTier, key: tuple[int, int]) -> Any:
        gate.wait(timeout=60)
        return real(self, key)

    monkeypatch.setattr(DiskTier, "_read", slow)
    engine.add_request("cached", TURNS[5], max_tokens=4)  # a second turn: its prefix is on disk
    engine.add_request("new", [7] * 20, max_tokens=4)  # nothing cached
    engine.step()
    scheduler = engine.scheduler
    assert [s.request_id for s in scheduler.running] == ["new"]
    assert [s.request_id for s in scheduler.waiting] == ["cached"]
    assert scheduler.num_loading == 1
    gate.set()
    engine.run()
    done = [engine.completions[r] for r in ("cached", "new")]
    _exact("llama", done)
    assert done[0].num_cached_tokens > 0 and engine.stats().disk_hit_tokens > 0
    engine.close()


def test_copies_read_for_an_admission_that_went_without_its_hit_are_given_back(
    tmp_path: Path,
) -> None:
    # Found by review: the scheduler checks a request's disk copies, then may admit it
    # without the hit (``no_hit``: alone, refused beside its own hit); its staged copies
    # then stayed until their entries left the disk, host memory outside every budget.
    _first_run("llama", tmp_path)
    engine = _engine("llama", tmp_path)
    store = engine._tier_store
    assert store is not None and store.disk is not None
    engine.add_request("cached", TURNS[5], max_tokens=16)
    seq = engine.scheduler.seqs["cached"]
    seq.no_hit = True
    while "cached" not in [s.request_id for s in engine.scheduler.running]:
        engine.step()
    assert store.disk.staged  # read and checked, then not used
    assert seq.request.num_computed_tokens > 0
    engine.run()
    assert store.disk.staged == {} and store.disk.expired > 0
    assert engine.stats().disk_hit_tokens == 0
    _exact("llama", [engine.completions["cached"]])
    engine.close()
    with pytest.raises(EngineError, match="tier store: apply after close"):
        store.apply([])
    hit = engine.manager.get_computed_blocks  # a live request, checked after close
    engine.add_request("late", TURNS[5], max_tokens=4)
    late = engine.scheduler.seqs["late"].request
    with pytest.raises(EngineError, match="tier store: check_hit after close"):
        store.check_hit(engine.manager, late, hit(late))
    store.close()  # a second close does nothing


def test_disk_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"disk_cache_dir .* and disk_memory_bytes"):
        CacheConfig(disk_cache_dir=tmp_path)
    with pytest.raises(PlanError, match=r"CacheConfig\.disk_memory_bytes"):
        CacheConfig(disk_cache_dir=tmp_path, disk_memory_bytes=0)
    _first_run("llama", tmp_path)
    with pytest.raises(DiskCacheError, match=r"another .*model"):
        _engine("gpt_oss", tmp_path)


def test_a_module_with_other_weights_is_refused_and_the_same_weights_reuse(
    tmp_path: Path,
) -> None:
    # Found by review: the fingerprint named the model only (a module's model_type), so a
    # module of the same architecture with other weights adopted the first one's blocks and
    # generated wrong tokens.  The weights' digest tells them apart, whatever the name.
    from hybridkv.engine.models import load_model

    def module_engine(seed: int) -> LLMEngine:
        return LLMEngine(load_model("llama", seed=seed), cache=_cache(tmp_path), keep_logits=True)

    _first_run("llama", tmp_path)  # the built-in model by name: seed 0
    with pytest.raises(DiskCacheError, match=r"another weights .*a module built otherwise"):
        module_engine(1)
    engine = module_engine(0)  # the same weights as a module: its blocks are reused
    _exact("llama", _serve(engine, TURNS[:1]))
    assert engine.stats().disk_hit_tokens > 0
    engine.close()


def test_an_engine_that_fails_to_start_leaves_the_disk_directory_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: a failure after the disk tier opened (a host buffer too big, or a
    # later check) kept the directory locked by the half-built engine, so a retry in the
    # same process was refused as "already open in this process".
    def cache(host: int) -> CacheConfig:
        return CacheConfig(
            block_size=4,
            num_blocks=32,
            max_model_len=64,
            host_memory_bytes=host,
            disk_cache_dir=tmp_path,
            disk_memory_bytes=1 << 20,
        )

    failures: list[Exception] = []  # held, as a handler or a log would hold them
    with pytest.raises(StorageAllocationError, match="host_memory_bytes: cannot allocate"):
        try:
            LLMEngine("llama", cache=cache(1 << 46))  # the host buffer cannot be had
        except Exception as exc:
            failures.append(exc)
            raise
    import hybridkv.engine.llm_engine as llm_engine

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the scheduler failed")

    with monkeypatch.context() as m:
        m.setattr(llm_engine, "Scheduler", broken)
        with pytest.raises(RuntimeError, match="the scheduler failed"):
            try:
                LLMEngine("llama", cache=cache(1 << 20))  # fails after the tiers opened
            except Exception as exc:
                failures.append(exc)
                raise
    LLMEngine("llama", cache=cache(1 << 20)).close()  # the directory is free again
    assert len(failures) == 2


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["run", "--model", "llama", "--quiet", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_reuses_its_disk_cache_across_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    d = str(tmp_path / "cache")
    args = ("--disk-cache", d, "--disk-memory", "16MiB", "--verify")
    code, first, _ = run_cli(capsys, *args)
    assert code == 0 and "disk tier" not in first
    code, second, _ = run_cli(capsys, *args)
    assert code == 0
    # the first wave's shared prefix comes from the first run's disk cache
    assert "disk tier: 32 of the 256 hit tokens read back from disk" in second
    assert "verify: all 8 requests (128 tokens) identical" in second
    # another device budget: the same blocks, so the same cache (it used to be refused as
    # "another layout": the arena's chunk count was in the manifest)
    code, third, err = run_cli(capsys, *args, "--memory", "32MiB")
    assert code == 0, err
    assert "disk tier: 32 of the 256 hit tokens read back from disk" in third
    assert "verify: all 8 requests (128 tokens) identical" in third


def test_run_refuses_bad_disk_settings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("x")
    cases = [
        (("--disk-cache", str(afile), "--disk-memory", "1MiB"), "is a file, not a directory"),
        (  # under a file: the file is named (it said "not writable")
            ("--disk-cache", str(afile / "sub"), "--disk-memory", "1MiB"),
            f"--disk-cache {afile / 'sub'}: {afile} is a file, not a directory",
        ),
        (("--disk-cache", "", "--disk-memory", "1MiB"), "--disk-cache: got an empty path"),
        (("--disk-cache", str(tmp_path / "d")), "--disk-cache: a disk tier also needs"),
        (("--disk-memory", "1MiB"), "--disk-memory: a disk tier also needs --disk-cache"),
        (("--disk-cache", str(tmp_path / "d"), "--disk-memory", "0"), "--disk-memory"),
        (("--disk-cache", str(tmp_path / "d"), "--disk-memory", "lots"), "--disk-memory"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(capsys, *argv)
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    d = str(tmp_path / "m")
    assert run_cli(capsys, "--disk-cache", d, "--disk-memory", "1MiB")[0] == 0
    code, _, err = main_err(
        capsys, "--model", "gpt_oss", "--disk-cache", d, "--disk-memory", "1MiB"
    )
    assert code == 2 and f"--disk-cache {d}: " in err and "another" in err


def main_err(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["run", "--quiet", *argv])
    out, err = capsys.readouterr()
    return code, out, err
