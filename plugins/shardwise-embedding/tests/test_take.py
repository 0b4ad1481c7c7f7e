"""The huge-page row gathers behind the sharded ops equal ``F.embedding`` and ``torch.cat``, gradients included."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from shardwise_embedding._take import place_columns, take_rows


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
