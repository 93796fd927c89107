"""Errors number a group's collectives one way, with and without COLLS_DEBUG=detail (issue 32)."""

from __future__ import annotations

import pytest

from colls import fingerprint
from colls.fingerprint import CallRecord, collective_tag, describe_tag, describe_tag_conflict
from colls.health import label


def _tag(op: str, seq: int, dtype: str = "float64") -> int:
    return collective_tag(seq, CallRecord(op, dtype=dtype, shape=(4,)).signature())


def test_default_mode_numbers_each_collective_by_its_sequence_number(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLLS_DEBUG", raising=False)
    assert label("all_reduce", 0) == "all_reduce #0"
    assert describe_tag(_tag("broadcast", 3)) == "broadcast #3"
    text = describe_tag_conflict(_tag("all_reduce", 0), _tag("broadcast", 0), 1)
    assert text == ("mismatched collectives: collective #0 is all_reduce on this rank but "
                    "broadcast on rank 1")


def test_detail_mode_shows_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under detail, collective k carries sequence number 2k + 1 (2k is its fingerprint exchange).
    monkeypatch.setenv("COLLS_DEBUG", "detail")
    assert label("all_reduce", 1) == "all_reduce #0"
    assert label("all_reduce", 5) == "all_reduce #2"
    assert describe_tag(_tag("broadcast", 7)) == "broadcast #3"
    text = describe_tag_conflict(_tag("all_reduce", 1), _tag("all_reduce", 1, "float32"), 1)
    assert "collective #0 (all_reduce) was called with a different dtype" in text
    assert fingerprint.shown_number(0) == fingerprint.shown_number(1) == 0
