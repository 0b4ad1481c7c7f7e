"""Fixtures of the shardwise-embedding tests: a fresh plugin manager per test, and test modules importable by ranks."""

from __future__ import annotations

from shardwise.testing.fixtures import fresh_plugin_manager, importable_tests

importable_tests(__file__)

__all__ = ["fresh_plugin_manager"]
