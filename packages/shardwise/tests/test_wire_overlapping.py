"""``wire.overlapping``: for a list of tensors, which may share memory with another, as ``shares_memory`` says.

It answers what :func:`shares_memory` answers on every pair (in O(n log n)),
for views of one buffer that are contiguous, strided or empty, copies, the
same object listed twice, and tensors of other buffers.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise import sdk
from shardwise._vocab.wire import overlapping, shares_memory

BASE = torch.arange(64.0)
OTHER = torch.arange(16.0)


@st.composite
def views(draw: Any) -> torch.Tensor:
    base = draw(st.sampled_from([BASE, OTHER]))
    start = draw(st.integers(0, base.numel()))
    stop = draw(st.integers(start, base.numel()))
    step = draw(st.integers(1, 3))
    view = base[start:stop:step]
    if draw(st.booleans()):
        view = view.flip(0)  # a copy: memory of its own
    return view


@settings(max_examples=300, deadline=None)
@given(st.lists(views(), max_size=8), st.data())
def test_the_same_answers_as_every_pair(tensors: list[torch.Tensor], data: Any) -> None:
    if tensors and data.draw(st.booleans()):
        tensors.append(tensors[data.draw(st.integers(0, len(tensors) - 1))])  # one object listed twice
    want = [any(j != i and shares_memory(t, u) for j, u in enumerate(tensors)) for i, t in enumerate(tensors)]
    assert overlapping(tensors) == want


def test_neighbours_touching_do_not_overlap_and_one_byte_more_does() -> None:
    a, b, c = BASE[0:8], BASE[8:16], BASE[7:9]
    assert overlapping([a, b]) == [False, False]
    assert overlapping([b, c, a]) == [True, True, True]
    assert overlapping([BASE[0:0], BASE[0:4]]) == [False, False]  # an empty tensor holds no byte
    assert overlapping([BASE[::2], BASE[1::2]]) == [True, True]  # interleaved spans count, as in shares_memory
    assert overlapping([]) == []
    assert sdk.overlapping is overlapping


def test_one_output_per_rank_of_4096_ranks() -> None:
    whole = torch.empty(4096 * 8)
    outs = list(whole.split(8))  # back to back: none overlaps
    assert not any(overlapping(outs))
    outs[100] = whole[101 * 8 - 2 : 101 * 8 + 6]  # reaches two elements into rank 101's output
    assert [i for i, shared in enumerate(overlapping(outs)) if shared] == [100, 101]
