"""colls.exit_hooks: who says goodbye at interpreter exit (the end-to-end cases are in
tests/core/test_exit_without_destroy.py)."""

from __future__ import annotations

import sys

import pytest

from colls import exit_hooks, lifecycle


@pytest.fixture
def destroyed(monkeypatch):
    """Pretend a group exists; record the calls of destroy_process_group instead of running it."""
    calls: list[bool] = []
    monkeypatch.setattr(lifecycle, "is_initialized", lambda: True)
    monkeypatch.setattr(lifecycle, "destroy_process_group", lambda: calls.append(True))
    monkeypatch.setattr(exit_hooks, "_died", False)
    monkeypatch.setattr(exit_hooks, "_owner_pid", exit_hooks.os.getpid())
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # install() chains it: undo after
    return calls


def test_a_normal_end_destroys_the_groups(destroyed):
    exit_hooks._leave()
    assert destroyed == [True]


def test_an_uncaught_exception_leaves_the_connections_to_drop(destroyed, monkeypatch):
    monkeypatch.setattr(exit_hooks, "_installed", False)
    monkeypatch.setattr(exit_hooks.atexit, "register", lambda handler: None)  # not pytest's exit
    exit_hooks.install()
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)  # what the interpreter does at exit
    exit_hooks._leave()
    assert destroyed == []


def test_a_forked_child_never_says_goodbye_on_its_parents_sockets(destroyed, monkeypatch):
    monkeypatch.setattr(exit_hooks, "_owner_pid", exit_hooks.os.getpid() + 1)
    exit_hooks._leave()
    assert destroyed == []
