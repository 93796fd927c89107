"""Conformance checks of the failure paths that run inside the suite's job (nobody dies).

Each check tests one clause of the backend contract (docs/plugins.md, "The Backend contract") and
names it in its failure message, so an author knows which promise the backend broke:

* ``timeout``: a receive nobody sends to raises CollsTimeoutError at the group timeout, no
  sooner and not much later;
* ``close``: ``close()`` with receives posted fails them (instead of leaving them pending for
  ever), and a second ``close()`` returns quietly;
* ``wrong_size``: a message whose size differs from the receive buffer fails the receive with a
  BackendError naming both sizes, and the stream stays usable.

A backend that hangs must not hang the suite: blocking calls that may never return run on a
watchdog thread with a generous bound, and the check fails (naming the clause) when it expires.
Dead peers need a job of their own per death: :mod:`colls.testing._dead_peer`.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

import colls
from colls import dtypes
from colls.errors import BackendError, CollsError, CollsTimeoutError
from colls.testing._checks_common import (
    Suite,
    bounded,
    expect,
    expect_equal,
    expect_raises,
    sentinel,
)

#: The contract clause each check tests (quoted in its failure message).
CLAUSES: Final = {
    "timeout": "Timeouts: every blocking step honours self.timeout and raises "
               "CollsTimeoutError instead of hanging",
    "close": "close() releases threads and connections, fails pending Works, and is idempotent",
    "wrong_size": "a message whose size differs from array.nbytes fails the receive with a "
                  "BackendError naming both sizes",
}

#: Timeout of the group the ``timeout`` check creates: long enough for a loaded host to build
#: the group within it, short enough to wait for.
SHORT_TIMEOUT_S: Final = 2.0
#: How much later than its timeout a receive may raise (a loaded 2-core host wakes late).
TIMEOUT_SLACK_S: Final = 5.0
#: Timers may fire this much early (clock granularity between threads).
EARLY_S: Final = 0.05
#: Seconds close() may take, and the bound on any call the watchdog runs.
CLOSE_BOUND_S: Final = 10.0
#: User tags of these checks (the suite's other p2p checks use tags below 16).
TIMEOUT_TAG: Final = 101
CLOSE_TAG: Final = 102
LARGER_TAG: Final = 103
SMALLER_TAG: Final = 104
#: Elements of a correct message, and of the wrong ones (int64).
RIGHT_COUNT: Final = 4
LARGER_COUNT: Final = 8
SMALLER_COUNT: Final = 2


def _ring(s: Suite) -> tuple[int, int]:
    return (s.rank + 1) % s.world_size, (s.rank - 1) % s.world_size


def check_timeout(s: Suite) -> None:
    """A receive with no sender raises CollsTimeoutError within the group timeout (plus slack)."""
    group = colls.new_group(timeout=SHORT_TIMEOUT_S)
    src = _ring(s)[1] if s.peers else None
    with s.case("timeout", what="recv that nobody sends to", timeout_s=SHORT_TIMEOUT_S,
                clause=CLAUSES["timeout"]):
        into = s.lib.make(np.zeros(RIGHT_COUNT, np.int64), dtypes.INT64)
        bound = SHORT_TIMEOUT_S + TIMEOUT_SLACK_S
        outcome, elapsed = bounded(
            lambda: colls.recv(into, src=src, group=group, tag=TIMEOUT_TAG), bound,
            f"recv with no sender on a group with a {SHORT_TIMEOUT_S:.0f} s timeout")
        expect(isinstance(outcome, CollsTimeoutError),
               f"recv with no sender ended with {_describe(outcome)} after {elapsed:.2f} s, "
               f"expected CollsTimeoutError")
        expect(elapsed >= SHORT_TIMEOUT_S - EARLY_S,
               f"recv raised CollsTimeoutError after {elapsed:.2f} s, before the group "
               f"timeout of {SHORT_TIMEOUT_S:.0f} s")
    colls.barrier()  # nobody closes the group (failing its peers' receives) before all timed out
    colls.destroy_process_group(group)


def check_close(s: Suite) -> None:
    """close() with receives posted fails them; close() twice is quiet."""
    group = colls.new_group()
    backend = group.backend
    src = _ring(s)[1] if s.peers else None
    with s.case("close", what="close() with receives posted", clause=CLAUSES["close"]):
        works = [
            backend.irecv(np.zeros(RIGHT_COUNT, np.int64), src, CLOSE_TAG),
            backend.irecv(np.zeros(RIGHT_COUNT, np.int64), None, CLOSE_TAG + 1),
        ]
        outcome, _ = bounded(backend.close, CLOSE_BOUND_S, "close() with receives posted")
        expect(outcome is None, f"close() ended with {_describe(outcome)}")
        for work, kind in zip(works, ("from a peer", "from any source"), strict=True):
            expect(work.is_completed(),
                   f"close() returned but the receive {kind} it should fail is still pending")
            failure = work.exception()
            expect(isinstance(failure, CollsError),
                   f"close() completed the receive {kind} with {_describe(failure)}, expected "
                   f"a BackendError")
    with s.case("close", what="close() a second time", clause=CLAUSES["close"]):
        outcome, _ = bounded(backend.close, CLOSE_BOUND_S, "a second close()")
        expect(outcome is None, f"a second close() ended with {_describe(outcome)}")
    colls.destroy_process_group(group)  # closes the backend a third time


def check_wrong_size(s: Suite) -> None:
    """A message larger or smaller than the receive buffer fails that receive, naming both sizes.

    The larger one meets a receive posted before it arrives, the smaller one (most likely) a
    receive posted after it arrived; a correct message on the same tag then still gets through.
    """
    if not s.peers:
        return
    i64 = dtypes.INT64
    right, left = _ring(s)
    item = np.dtype(np.int64).itemsize
    with s.case("wrong_size", what="message larger than the posted receive",
                clause=CLAUSES["wrong_size"]):
        into = s.lib.make(np.zeros(RIGHT_COUNT, np.int64), i64)
        work = colls.irecv(into, src=left, tag=LARGER_TAG)
        colls.barrier()  # every receive is posted before any message is sent
        colls.send(s.lib.make(np.arange(LARGER_COUNT, dtype=np.int64), i64), dst=right,
                   tag=LARGER_TAG)
        _expect_size_error(work, LARGER_COUNT * item, RIGHT_COUNT * item)
    with s.case("wrong_size", what="message smaller than a later receive",
                clause=CLAUSES["wrong_size"]):
        colls.send(s.lib.make(np.arange(SMALLER_COUNT, dtype=np.int64), i64), dst=right,
                   tag=SMALLER_TAG)
        colls.barrier()
        into = s.lib.make(np.zeros(RIGHT_COUNT, np.int64), i64)
        work = colls.irecv(into, src=left, tag=SMALLER_TAG)
        _expect_size_error(work, SMALLER_COUNT * item, RIGHT_COUNT * item)
    with s.case("wrong_size", what="a correct message after the wrong ones",
                clause=CLAUSES["wrong_size"]):
        message = np.arange(RIGHT_COUNT, dtype=np.int64) + 10 * s.rank
        into = s.lib.make(np.zeros(RIGHT_COUNT, np.int64), i64)
        work = colls.irecv(into, src=left, tag=LARGER_TAG)
        colls.send(s.lib.make(message, i64), dst=right, tag=LARGER_TAG)
        work.wait(timeout=CLOSE_BOUND_S)
        expect_equal(s.lib.to_numpy(into), np.arange(RIGHT_COUNT, dtype=np.int64) + 10 * left,
                     "the correct message")
        sentinel(s)


def _expect_size_error(work: Any, sent: int, buffer: int) -> None:
    expect_raises(BackendError, lambda: work.wait(timeout=CLOSE_BOUND_S),
                  contains=(str(sent), str(buffer)))


def _describe(outcome: Any) -> str:
    if isinstance(outcome, BaseException):
        return f"{type(outcome).__name__}: {outcome}"
    return f"the value {outcome!r}" if outcome is not None else "success"
