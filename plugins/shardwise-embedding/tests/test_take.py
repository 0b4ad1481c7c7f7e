"""The huge-page row gathers behind the sharded ops equal ``F.embedding`` and ``torch.cat``, gradients included."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from shardwise_embedding._take import place_columns, pool_rows, take_rows


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    cols=st.integers(1, 9),
    n=st.integers(0, 60),
    padding=st.one_of(st.none(), st.integers(0, 39)),
    max_norm=st.one_of(st.none(), st.floats(0.1, 3.0)),
    seed=st.integers(0, 2**16),
)
def test_take_rows_is_f_embedding(
    rows: int, cols: int, n: int, padding: Optional[int], max_norm: Optional[float], seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    padding = None if padding is None or padding >= rows else padding
    dense = torch.randn(rows, cols, generator=gen)
    index = torch.randint(0, rows, (n,), generator=gen)
    grad = torch.randn(n, cols, generator=gen)
    want_w, got_w = dense.clone().requires_grad_(), dense.clone().requires_grad_()
    want = F.embedding(index, want_w, padding, max_norm)
    got = take_rows(got_w, index, padding, max_norm)
    torch.testing.assert_close(got, want)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(got_w.grad, want_w.grad)
    torch.testing.assert_close(got_w.detach(), want_w.detach())  # max_norm renormed the same rows in place


def test_take_rows_large_and_broadcast_gradient() -> None:
    w = torch.randn(20_000, 128, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    index = torch.randint(0, 20_000, (50_000,))
    take_rows(w, index).sum().backward()  # a broadcast (stride-0) gradient
    F.embedding(index, ref).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad)
    assert not w.grad.untyped_storage().resizable()  # the gradient is on its own (huge-page) mapping


def test_take_rows_without_grad() -> None:
    w = torch.randn(5, 3)
    out = take_rows(w, torch.tensor([4, 0, 4]))
    assert not out.requires_grad
    torch.testing.assert_close(out, w[[4, 0, 4]])


@pytest.mark.parametrize("widths", [[3], [2, 5], [0, 4, 1], [1, 1, 1, 1]])
@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_place_columns_is_cat_of_blocks(widths: list[int], order: str) -> None:
    rows = 6
    firsts = [sum(widths[:i]) for i in range(len(widths))]
    blocks_data = [torch.randn(rows, w) for w in widths]
    # The flat buffer holds the blocks in some order (as they arrive from ranks), each row-major.
    arrival = list(range(len(widths)))[:: 1 if order == "forward" else -1]
    flat = torch.cat([blocks_data[i].reshape(-1) for i in arrival]).requires_grad_()
    starts, cursor = {}, 0
    for i in arrival:
        starts[i] = cursor
        cursor += rows * widths[i]
    blocks = [(starts[i], firsts[i], widths[i]) for i in arrival]
    out = place_columns(flat, blocks, rows, sum(widths))
    torch.testing.assert_close(out, torch.cat(blocks_data, dim=1))
    grad = torch.randn(rows, sum(widths))
    out.backward(grad)
    want = torch.cat([grad[:, firsts[i] : firsts[i] + widths[i]].reshape(-1) for i in arrival])
    torch.testing.assert_close(flat.grad, want)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 30),
    cols=st.integers(1, 7),
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=12),
    padding=st.one_of(st.none(), st.integers(0, 29)),
    weighted=st.booleans(),
    max_norm=st.one_of(st.none(), st.floats(0.1, 3.0)),
    seed=st.integers(0, 2**16),
)
def test_pool_rows_is_f_embedding_bag_sum(
    rows: int, cols: int, lengths: list[int], padding: Optional[int], weighted: bool, max_norm: Optional[float],
    seed: int,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    padding = None if padding is None or padding >= rows else padding
    dense = torch.randn(rows, cols, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int64)
    ids = torch.randint(0, rows, (int(lens.sum()),), generator=gen)
    weights = torch.randn(ids.numel(), generator=gen) if weighted else None
    grad = torch.randn(len(lengths), cols, generator=gen)
    want_w, got_w = dense.clone().requires_grad_(), dense.clone().requires_grad_()
    want = F.embedding_bag(ids, want_w, lens.cumsum(0) - lens, max_norm=max_norm, mode="sum",
                           per_sample_weights=weights, padding_idx=padding)
    got = pool_rows(got_w, ids, lens, weights, padding, max_norm)
    torch.testing.assert_close(got, want)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(got_w.grad, want_w.grad)
    torch.testing.assert_close(got_w.detach(), want_w.detach())


def test_pool_rows_large_table_in_chunks() -> None:
    """More table rows than one pooling call of the backward writes: every chunk lands in its place."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(40_000, 32, generator=gen, requires_grad=True)
    ref = w.detach().clone().requires_grad_()
    ids = torch.randint(0, 40_000, (60_000,), generator=gen)
    lens = torch.full((3_000,), 20)
    weights = torch.rand(60_000, generator=gen)
    grad = torch.randn(3_000, 32, generator=gen)
    pool_rows(w, ids, lens, weights).backward(grad)
    F.embedding_bag(ids, ref, lens.cumsum(0) - lens, mode="sum", per_sample_weights=weights).backward(grad)
    torch.testing.assert_close(w.grad, ref.grad)


def test_pool_rows_weights_that_require_grad_take_the_dense_path() -> None:
    w = torch.randn(6, 3, requires_grad=True)
    weights = torch.rand(4, requires_grad=True)
    out = pool_rows(w, torch.tensor([0, 5, 5, 2]), torch.tensor([1, 3]), weights)
    out.sum().backward()
    assert weights.grad is not None and w.grad is not None
