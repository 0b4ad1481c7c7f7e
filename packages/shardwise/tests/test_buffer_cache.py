"""The freed-buffer cache: a bounded default, least recently freed evicted first, and ``shardwise.empty_cache``.

Issue 17, defect 3: by default up to 1 GiB of freed huge-page buffers per
rank stayed resident, with no public way to release them. Now the default
cap is :data:`~shardwise._comm.buffers.DEFAULT_CACHE_MB` (256 MiB), a freed
mapping that does not fit evicts the least recently freed ones, and
``shardwise.empty_cache()`` gives every idle mapping back to the kernel.
"""

from __future__ import annotations

import gc
from typing import Iterator

import pytest
import torch

import shardwise
from shardwise._comm import buffers

MIB = 1 << 20
pytestmark = pytest.mark.skipif(not buffers.huge_pages_enabled(), reason="no MADV_HUGEPAGE on this platform")


def _rss() -> int:
    """This process's resident set, in bytes (Linux: huge-page mappings exist only there)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _floats(mib: int) -> tuple[int]:
    return (mib * MIB // 4,)


@pytest.fixture(autouse=True)
def empty_to_start_with() -> Iterator[None]:
    """Each test starts and ends with no idle mapping (others' leftovers would blur the byte counts)."""
    gc.collect()
    buffers.empty_cache()
    yield
    gc.collect()
    buffers.empty_cache()


def test_empty_cache_is_public() -> None:
    assert shardwise.empty_cache is buffers.empty_cache and "empty_cache" in shardwise.__all__
    assert shardwise.empty_cache() == 0  # nothing cached: nothing released


def test_empty_cache_releases_the_cached_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "128")
    taken = [buffers.empty(_floats(16), torch.float32).fill_(1.0) for _ in range(4)]  # 64 MiB, resident
    del taken
    gc.collect()
    assert buffers.cached_bytes() == 64 * MIB
    before = _rss()
    assert shardwise.empty_cache() == 64 * MIB
    assert buffers.cached_bytes() == 0
    # The kernel took the pages back (the fill made them resident; allow for other allocations meanwhile).
    assert before - _rss() >= 48 * MIB, (before, _rss())


def test_empty_cache_leaves_buffers_in_use_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "64")
    kept = buffers.empty(_floats(8), torch.float32).fill_(3.0)
    freed = buffers.empty(_floats(8), torch.float32)
    live = buffers.live_bytes()
    del freed
    gc.collect()
    assert shardwise.empty_cache() == 8 * MIB
    assert buffers.live_bytes() == live - 8 * MIB
    assert bool((kept == 3.0).all())  # still mapped and readable
    again = buffers.zeros(_floats(8), torch.float32)  # a fresh mapping after the release
    assert not again.any()


def test_the_default_cap_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDWISE_BUFFER_CACHE_MB", raising=False)
    assert buffers.DEFAULT_CACHE_MB == 256
    assert buffers.cache_limit() == 256 * MIB
    # 320 MiB of buffers, never touched (so never resident), freed at once: the cache keeps 256 MiB of them.
    taken = [buffers.empty(_floats(8), torch.float32) for _ in range(40)]
    del taken
    gc.collect()
    assert buffers.cached_bytes() == 256 * MIB


def test_the_environment_still_sets_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "16")
    assert buffers.cache_limit() == 16 * MIB
    taken = [buffers.empty(_floats(8), torch.float32) for _ in range(3)]
    del taken
    gc.collect()
    assert buffers.cached_bytes() == 16 * MIB
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "0")
    assert buffers.empty_cache() == 16 * MIB
    taken = [buffers.empty(_floats(8), torch.float32)]
    del taken
    gc.collect()
    assert buffers.cached_bytes() == 0


def test_a_freed_buffer_that_does_not_fit_evicts_the_least_recently_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "24")
    a, b, c = (buffers.empty(_floats(8), torch.float32) for _ in range(3))
    c_at = c.data_ptr()
    d = buffers.empty(_floats(12), torch.float32)
    d_at = d.data_ptr()
    del a
    gc.collect()
    del b
    gc.collect()
    del c
    gc.collect()
    assert buffers.cached_bytes() == 24 * MIB
    del d  # 12 MiB more: a and b (the oldest) go, c stays
    gc.collect()
    assert buffers.cached_bytes() == 20 * MIB
    reused_d = buffers.empty(_floats(12), torch.float32)
    reused_c = buffers.empty(_floats(8), torch.float32)
    assert reused_d.data_ptr() == d_at and reused_c.data_ptr() == c_at
    assert buffers.cached_bytes() == 0
