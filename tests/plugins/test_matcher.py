"""colls.backend.Matcher: the receive side a backend gets for free, tested in one process.

The multi-process proof is storemail, which uses it and passes the conformance suite
(test_third_party.py); here each rule is checked on its own: FIFO per (source, tag), any-source
order across sources, the size error, a lost peer, close, and completion outside the lock.
"""

from __future__ import annotations

import numpy as np
import pytest

from colls.backend import Matcher
from colls.errors import BackendError, NetworkError
from colls.matching import Matcher as MatcherFromItsModule

TIMEOUT_S = 5.0


def _message(value: int, count: int = 3) -> bytes:
    return np.full(count, value, dtype=np.int64).tobytes()


def _buffer(count: int = 3) -> np.ndarray:
    return np.zeros(count, dtype=np.int64)


def test_colls_backend_re_exports_the_matcher() -> None:
    assert Matcher is MatcherFromItsModule


def test_messages_of_one_source_and_tag_match_receives_in_order() -> None:
    matcher = Matcher(TIMEOUT_S, name="test")
    early = [_buffer() for _ in range(2)]
    works = [matcher.post(b, 1, 7) for b in early]  # posted before the messages
    for value in (10, 11, 12):
        matcher.arrived(1, 7, _message(value))
    late = _buffer()
    last = matcher.post(late, 1, 7)  # the third message was unexpected: it waited
    assert [w.source_rank() for w in [*works, last]] == [1, 1, 1]
    for buffer, value in zip([*early, late], (10, 11, 12), strict=True):
        np.testing.assert_array_equal(buffer, np.full(3, value))
    assert matcher.pending() == 0


def test_tags_and_sources_are_matched_apart() -> None:
    matcher = Matcher(TIMEOUT_S)
    from_2, tag_8 = _buffer(), _buffer()
    w_src = matcher.post(from_2, 2, 7)
    w_tag = matcher.post(tag_8, 1, 8)
    matcher.arrived(1, 7, _message(1))  # nobody wants (1, 7): it waits
    assert not w_src.is_completed() and not w_tag.is_completed()
    matcher.arrived(1, 8, _message(2))
    matcher.arrived(2, 7, _message(3))
    assert w_tag.source_rank() == 1 and w_src.source_rank() == 2
    np.testing.assert_array_equal(tag_8, np.full(3, 2))
    np.testing.assert_array_equal(from_2, np.full(3, 3))
    leftover = _buffer()
    assert matcher.post(leftover, 1, 7).source_rank() == 1
    np.testing.assert_array_equal(leftover, np.full(3, 1))


def test_any_source_receives_take_messages_in_arrival_order() -> None:
    matcher = Matcher(TIMEOUT_S)
    for src, value in ((3, 30), (1, 10), (2, 20)):
        matcher.arrived(src, 0, _message(value))
    got = []
    for _ in range(3):
        buffer = _buffer()
        sender = matcher.post(buffer, None, 0).source_rank()
        got.append((sender, int(buffer[0])))
    assert got == [(3, 30), (1, 10), (2, 20)]


def test_an_earlier_any_source_receive_wins_over_a_later_specific_one() -> None:
    matcher = Matcher(TIMEOUT_S)
    anyone, specific = _buffer(), _buffer()
    w_any = matcher.post(anyone, None, 4)
    w_specific = matcher.post(specific, 5, 4)
    matcher.arrived(5, 4, _message(1))
    matcher.arrived(5, 4, _message(2))
    assert w_any.source_rank() == 5 and w_specific.source_rank() == 5
    np.testing.assert_array_equal(anyone, np.full(3, 1))
    np.testing.assert_array_equal(specific, np.full(3, 2))


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_message_of_the_wrong_size_fails_its_receive_naming_both_sizes(
        posted_first: bool) -> None:
    matcher = Matcher(TIMEOUT_S, name="test")
    buffer = _buffer(3)
    if posted_first:
        work = matcher.post(buffer, 1, 0)
        matcher.arrived(1, 0, _message(9, count=5))
    else:
        matcher.arrived(1, 0, _message(9, count=5))
        work = matcher.post(buffer, 1, 0)
    with pytest.raises(BackendError, match=r"test recv from rank 1 tag 0: the message from rank 1 "
                                           r"with tag 0 has 40 bytes but the receive buffer has "
                                           r"24 bytes"):
        work.wait()
    np.testing.assert_array_equal(buffer, np.zeros(3))


def test_a_lost_peer_fails_its_receives_and_any_source_ones_but_not_others() -> None:
    matcher = Matcher(TIMEOUT_S)
    from_1 = matcher.post(_buffer(), 1, 0)
    anyone = matcher.post(_buffer(), None, 0)
    from_2 = matcher.post(_buffer(), 2, 0)
    lost = NetworkError("test: connection to rank 1 (host:1) lost")
    matcher.peer_lost(1, lost)
    assert from_1.exception() is lost and anyone.exception() is lost
    assert not from_2.is_completed()
    assert matcher.post(_buffer(), 1, 3).exception() is lost  # later receives fail at once
    matcher.arrived(2, 0, _message(4))
    assert from_2.source_rank() == 2


def test_close_fails_every_posted_receive_once_and_refuses_later_ones() -> None:
    matcher = Matcher(TIMEOUT_S, name="test")
    works = [matcher.post(_buffer(), 1, 0), matcher.post(_buffer(), None, 1)]
    matcher.arrived(2, 5, _message(1))  # unexpected: dropped by close
    matcher.close()
    for work in works:
        assert isinstance(work.exception(), BackendError)
        assert str(work.exception()) == "test backend closed"
    matcher.close(BackendError("again"))  # idempotent: the first error stays
    later = matcher.post(_buffer(), 2, 5)
    assert str(later.exception()) == "test backend closed"
    matcher.arrived(1, 0, _message(2))  # dropped quietly
    assert matcher.pending() == 0


def test_receives_time_out_at_the_matchers_timeout() -> None:
    matcher = Matcher(0.05, name="test")
    work = matcher.post(_buffer(), 1, 0)
    assert work.default_timeout == 0.05
    with pytest.raises(TimeoutError, match="test recv from rank 1 tag 0 did not complete"):
        work.wait()


def test_completion_callbacks_may_post_more_receives() -> None:
    matcher = Matcher(TIMEOUT_S)
    second = _buffer()
    chained = []
    first = matcher.post(_buffer(), 1, 0)
    first.add_done_callback(lambda _w: chained.append(matcher.post(second, 1, 0)))
    matcher.arrived(1, 0, _message(1))  # completes first; its callback posts (no deadlock)
    matcher.arrived(1, 0, _message(2))
    assert chained[0].source_rank() == 1
    np.testing.assert_array_equal(second, np.full(3, 2))


def test_payloads_may_be_arrays_of_any_dtype() -> None:
    matcher = Matcher(TIMEOUT_S)
    sent = np.array([1 + 2j, 3 - 4j], dtype=np.complex128)
    into = np.zeros(2, dtype=np.complex128)
    work = matcher.post(into, 0, 0)
    matcher.arrived(0, 0, sent)
    assert work.source_rank() == 0
    np.testing.assert_array_equal(into, sent)
