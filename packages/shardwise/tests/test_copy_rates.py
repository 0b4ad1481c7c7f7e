"""The copy prices a one-copy layout change cuts its boxes by (``shardwise._comm.copy_rates``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardwise._comm import copy_rates
from shardwise._comm.copy_rates import FAR_SMALL, LOCAL, MIN_OBSERVED_BYTES, SCALE

MIB = MIN_OBSERVED_BYTES


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    copy_rates.forget()
    yield
    copy_rates.forget()


def _seconds(ps_per_byte: float, nbytes: int = MIB) -> float:
    return ps_per_byte * nbytes / 1e12


def test_nothing_timed_publishes_zeros_and_prices_are_the_defaults() -> None:
    assert copy_rates.published() == [0, 0, 0]
    assert copy_rates.prices([copy_rates.published()] * 3, 2) == (2 * SCALE, SCALE)


def test_small_copies_are_not_timed() -> None:
    copy_rates.observe(LOCAL, MIB - 1, _seconds(100, MIB - 1))
    copy_rates.observe(LOCAL, MIB, 0.0)
    assert copy_rates.published() == [0, 0, 0]


def test_a_reading_is_the_median_of_the_last_few_so_a_first_copy_into_fresh_memory_does_not_stick() -> None:
    copy_rates.observe(FAR_SMALL, MIB, _seconds(2000))  # faults the pages in: ten times slower
    for _ in range(3):
        copy_rates.observe(FAR_SMALL, 4 * MIB, _seconds(150, 4 * MIB))
    assert copy_rates.published()[FAR_SMALL] == 150
    for _ in range(copy_rates._KEPT):
        copy_rates.observe(FAR_SMALL, MIB, _seconds(120))
    assert copy_rates.published()[FAR_SMALL] == 120  # the older readings have left


def test_prices_are_each_kinds_mean_over_the_ranks_that_timed_it_against_the_local_copies() -> None:
    rows = [[100, 0, 120], [0, 140, 0], [100, 160, 0]]
    # Local 100, far 4 KiB pages (140 + 160) / 2 = 150: 1.5x; far huge pages 120: 1.2x.
    assert copy_rates.prices(rows, 2) == (round(1.5 * SCALE), round(1.2 * SCALE))
    # Without a local reading there is nothing to compare with: the defaults.
    assert copy_rates.prices([[0, 150, 120]], 3) == (3 * SCALE, SCALE)


def test_prices_are_clamped_so_one_odd_reading_cannot_hand_a_rank_a_whole_box() -> None:
    assert copy_rates.prices([[100, 10_000, 1]], 2) == (4 * SCALE, SCALE // 2)


@given(rows=st.lists(st.lists(st.integers(0, 10**4), min_size=3, max_size=3), min_size=1, max_size=8))
def test_prices_depend_on_the_rows_alone_in_any_order(rows: list[list[int]]) -> None:
    # Every rank computes them from the same gathered rows: no rank may bring state of its own.
    copy_rates.observe(LOCAL, MIB, _seconds(1))
    got = copy_rates.prices(rows, 2)
    copy_rates.forget()
    assert copy_rates.prices(list(reversed(rows)), 2) == got
    small, huge = got
    assert SCALE // 2 <= small <= 4 * SCALE and SCALE // 2 <= huge <= 4 * SCALE
