"""What ``shardwise.init`` / ``destroy`` log at DEBUG on the ``shardwise.session`` logger.

``init`` says which backend it chose and why: named by ``init(backend=)``
or by ``SHARDWISE_BACKEND``, or chosen automatically (preferred under the
launcher's family, or the highest priority), with the launcher, its family,
the rank, the available backends and why each other one is unavailable.
``destroy`` and the exit handler say what they tear down. Nothing is logged
above DEBUG, except a WARNING when the automatic choice passes over the
backend preferred under the launcher's family because it cannot run (the
fallback's own errors would hide why).
"""

from __future__ import annotations

import logging
from typing import Iterable

import pytest

import shardwise
from shardwise import Availability, Backend, hookimpl, plugins
from shardwise._session import runtime

import core_test_backend

LOGGER = "shardwise.session"


@pytest.fixture(autouse=True)
def _clean(clean_session: None) -> None:
    """Every test here starts a session: see ``clean_session``."""


class _Backends:
    """A plugin contributing backend records."""

    def __init__(self, *records: Backend) -> None:
        self.records = records

    @hookimpl
    def shardwise_backends(self) -> Iterable[Backend]:
        return self.records


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_automatic_choice_names_the_rule_the_launcher_and_every_backend(caplog: pytest.LogCaptureFixture) -> None:
    unavailable = Backend(
        name="widget",
        is_available=lambda: Availability(False, "widget has no widgets"),
        create_group=core_test_backend._create,
    )
    plugins.register(_Backends(unavailable), name="widgets")
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    shardwise.init(environ={})
    assert _lines(caplog) == [
        "backend test-gloo chosen: SHARDWISE_BACKEND unset and no backend= given, so chosen automatically: no "
        "available backend is preferred under launcher family 'single', and it has the highest priority; available "
        "backends: test-gloo (priority 0); unavailable: widget: widget has no widgets (launcher single, family "
        "single, rank 0 of 1)"
    ]


def test_automatic_choice_preferred_under_the_launchers_family(caplog: pytest.LogCaptureFixture) -> None:
    preferred = Backend(
        name="home",
        is_available=lambda: Availability(True),
        create_group=core_test_backend._create,
        priority=-5,
        preferred_under=("single",),
    )
    plugins.register(_Backends(preferred), name="home")
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    assert shardwise.init(environ={}).backend == "gloo"
    (line,) = _lines(caplog)
    assert line.startswith(
        "backend home chosen: SHARDWISE_BACKEND unset and no backend= given, so chosen automatically: it is "
        "preferred under launcher family 'single'; available backends: "
    ), line
    assert "home (priority -5)" in line and "test-gloo (priority 0)" in line, line


def test_a_preferred_backend_that_cannot_run_is_a_warning_naming_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stranded = Backend(
        name="home",
        is_available=lambda: Availability(False, "no library of the launcher's kind"),
        create_group=core_test_backend._create,
        preferred_under=("single",),
    )
    plugins.register(_Backends(stranded), name="home")
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert shardwise.init(environ={}).backend == "gloo"
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        (
            "WARNING",
            "shardwise: the single launcher's own backend was passed over, so 'test-gloo' is used instead: "
            "backend 'home' cannot run here: no library of the launcher's kind",
        )
    ]


def test_a_named_backend_says_who_named_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    shardwise.init(environ={"SHARDWISE_BACKEND": "test-gloo"})
    shardwise.destroy()
    shardwise.init("test-gloo", environ={"SHARDWISE_BACKEND": "elsewhere"})
    lines = _lines(caplog)
    assert lines == [
        "backend test-gloo chosen: named by SHARDWISE_BACKEND=test-gloo; automatic choice skipped "
        "(launcher single, family single, rank 0 of 1)",
        "destroy: tearing down the gloo group (rank 0 of 1)",
        "backend test-gloo chosen: named by init(backend=...); automatic choice skipped "
        "(launcher single, family single, rank 0 of 1)",
    ]


def test_the_exit_handler_says_it_does_not_wait(caplog: pytest.LogCaptureFixture) -> None:
    shardwise.init("test-gloo", environ={})
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    runtime._at_exit()
    assert _lines(caplog) == [
        "exit without shardwise.destroy(): releasing the gloo group of rank 0 without waiting for the other ranks"
    ]


def test_nothing_is_logged_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    shardwise.init(environ={})
    shardwise.destroy()
    assert _lines(caplog) == []
