"""MatchTable: FIFO matching of posted receives and unexpected messages per (src, tag)."""

from __future__ import annotations

from colls.work import Work
from colls_plugins.tcp._matching import MatchTable, RecvOp


def _op(src, tag):
    return RecvOp(Work(), memoryview(bytearray(1)), src, tag)


def test_arrival_goes_to_the_earliest_posted_of_specific_and_any_source():
    table = MatchTable()
    specific, anysrc, later = _op(2, 5), _op(None, 5), _op(2, 5)
    for op in (specific, anysrc, later):
        table.post(op)
    assert table.match_arrival(1, 5) is anysrc  # only the any-source one accepts rank 1
    assert table.match_arrival(2, 5) is specific
    assert table.match_arrival(2, 6) is None
    assert table.match_arrival(2, 5) is later
    assert table.posted_count() == 0


def test_any_source_takes_the_earliest_unexpected_arrival():
    table = MatchTable()
    first = table.add_unexpected(3, 1, 4)
    second = table.add_unexpected(0, 1, 4)
    third = table.add_unexpected(3, 1, 4)
    assert table.take_unexpected(None, 1) is first
    assert table.take_unexpected(0, 2) is None
    assert table.take_unexpected(None, 1) is second
    assert table.take_unexpected(3, 1) is third
    assert not table.has_unexpected()


def test_failure_helpers_remove_what_they_name():
    table = MatchTable()
    ops = [_op(1, 0), _op(2, 0), _op(None, 0), _op(1, 9)]
    for op in ops:
        table.post(op)
    message = table.add_unexpected(1, 0, 8)
    assert set(table.remove_from(1)) == {ops[0], ops[3]}
    assert table.remove_any_source() == [ops[2]]
    table.discard(message)
    assert not table.has_unexpected()
    assert table.remove_all() == [ops[1]]
