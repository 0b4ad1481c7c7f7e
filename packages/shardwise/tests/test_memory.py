"""``shardwise._comm.buffers``: large CPU buffers on their own huge-page mappings, small ones from torch."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise._comm import buffers as _memory

MAPPED = _memory.huge_pages_enabled()
BIG = (_memory.HUGE_PAGE_MIN_BYTES // 4 // 256, 256)  # float32: exactly the threshold


def _is_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage is not resizable (torch.frombuffer over an mmap), unlike torch's own."""
    return not t.untyped_storage().resizable()


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                                   torch.int8, torch.bool, torch.complex64])
def test_large_buffers_are_mapped_zeroed_and_usable(dtype: torch.dtype) -> None:
    t = _memory.zeros((2048, 2048), dtype)  # at least 4 MiB even for 1-byte dtypes
    assert _is_mapped(t)
    assert t.shape == (2048, 2048) and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert not t.any()
    t.fill_(1)
    assert bool((t == 1).all())
    e = _memory.empty((4, 1024, 1024), dtype)
    assert e.shape == (4, 1024, 1024) and e.dtype == dtype and _is_mapped(e)


def test_small_buffers_come_from_torch() -> None:
    t = _memory.zeros((BIG[0] - 1, BIG[1]), torch.float32)
    assert not _is_mapped(t) and not t.any()
    assert not _is_mapped(_memory.empty((4,), torch.float32))


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
def test_threshold_is_inclusive() -> None:
    assert _is_mapped(_memory.empty(BIG, torch.float32))


def test_switch_off_with_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv("SHARDWISE_HUGE_PAGES", off)
        assert not _memory.huge_pages_enabled()
        t = _memory.zeros(BIG, torch.float32)
        assert not _is_mapped(t) and not t.any()
    monkeypatch.setenv("SHARDWISE_HUGE_PAGES", "1")
    assert _memory.huge_pages_enabled() == hasattr(mmap, "MADV_HUGEPAGE")


def test_other_devices_use_torch() -> None:
    t = _memory.empty(BIG, torch.float32, torch.device("meta"))
    assert t.device.type == "meta" and t.shape == BIG


def test_like_keeps_dtype_and_takes_a_shape() -> None:
    src = torch.ones(BIG, dtype=torch.float64)
    assert _memory.empty_like(src).shape == src.shape
    other = _memory.empty_like(src, (7, 3))
    assert other.shape == (7, 3) and other.dtype == torch.float64


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
def test_mapping_lives_as_long_as_any_view() -> None:
    t = _memory.zeros(BIG, torch.float32)
    view = t[10:20]
    view.fill_(3)
    del t
    gc.collect()
    assert bool((view == 3).all())  # still readable: the view keeps the mapping alive


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
def test_autograd_and_grad_accumulation_accept_mapped_tensors() -> None:
    w = torch.zeros(BIG, requires_grad=True)
    g = _memory.zeros(BIG, torch.float32).fill_(2)
    w.backward(g)
    assert w.grad is not None and bool((w.grad == 2).all())
    w.backward(g)
    assert bool((w.grad == 4).all())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 3000), cols=st.integers(0, 700), dtype=st.sampled_from([torch.float32, torch.int16]))
def test_any_shape_gives_a_zero_tensor_of_that_shape(rows: int, cols: int, dtype: torch.dtype) -> None:
    t = _memory.zeros((rows, cols), dtype)
    assert t.shape == (rows, cols) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
def test_freed_mappings_are_reused_and_zeros_are_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "64")
    t = _memory.empty((3 << 20,), torch.float32)  # 12 MiB
    where = t.data_ptr()
    t.fill_(7)
    del t
    gc.collect()
    assert _memory.cached_bytes() >= 12 << 20
    again = _memory.zeros((3 << 20,), torch.float32)  # the same size class: the same mapping, zeroed
    assert again.data_ptr() == where and not again.any()
    nearby = _memory.empty(((3 << 20) - 100,), torch.float32)  # rounds up to the same 12 MiB
    assert nearby.data_ptr() != where  # `again` still holds that one
    del again, nearby
    gc.collect()


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
def test_live_and_peak_bytes_follow_the_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "64")
    gc.collect()
    base = _memory.live_bytes()
    _memory.reset_peak()
    a = _memory.empty((1 << 20,), torch.float32)  # 4 MiB
    b = _memory.empty((2 << 20,), torch.float32)  # 8 MiB
    assert _memory.live_bytes() == base + (12 << 20)
    del a, b
    gc.collect()
    assert _memory.live_bytes() == base and _memory.peak_live_bytes() == base + (12 << 20)


@pytest.mark.skipif(not MAPPED, reason="no MADV_HUGEPAGE on this platform")
def test_the_cache_stays_within_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "0")
    gc.collect()
    before = _memory.cached_bytes()
    taken = [_memory.empty((1 << 20,), torch.float32) for _ in range(3)]  # may reuse cached ones
    during = _memory.cached_bytes()
    del taken
    gc.collect()
    assert _memory.cached_bytes() == during <= before  # none kept: they went back to the kernel
    monkeypatch.setenv("SHARDWISE_BUFFER_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="SHARDWISE_BUFFER_CACHE_MB"):
        _memory.empty((1 << 20,), torch.float32)
