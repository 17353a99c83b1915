"""benchmarks/timing.py on CPU: every record a GPU benchmark emits says the commit it was measured at."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import timing


@pytest.fixture
def fresh_commit():
    timing.commit.cache_clear()
    yield
    timing.commit.cache_clear()


def emitted(record: dict) -> dict:
    out = io.StringIO()
    timing.emit(record, out)
    return json.loads(out.getvalue())


def test_an_installed_build_is_named_by_the_environment(monkeypatch, fresh_commit):
    monkeypatch.setenv("UNIPAGE_COMMIT", "abc1234+tree")
    row = emitted({"bench": "x", "value": 1})
    assert row["commit"] == "abc1234+tree" and row["bench"] == "x" and row["value"] == 1


def test_a_checkout_is_named_by_git(monkeypatch, fresh_commit):
    monkeypatch.delenv("UNIPAGE_COMMIT", raising=False)
    row = emitted({"bench": "x"})
    assert isinstance(row["commit"], str)
    if os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".git")):
        assert row["commit"]  # `git describe --always` names any checkout


def test_a_record_keeps_its_own_commit(monkeypatch, fresh_commit):
    monkeypatch.setenv("UNIPAGE_COMMIT", "abc1234")
    assert emitted({"bench": "x", "commit": "mine"})["commit"] == "mine"
