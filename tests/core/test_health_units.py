"""colls.health and the tcp mismatch tracker, in one process (fast, deterministic)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from colls.errors import BackendError, CollsTimeoutError, NetworkError
from colls.fingerprint import (
    SEQUENCE_BITS,
    SIGNATURE_BITS,
    CallRecord,
    CollectiveMismatchError,
    collective_tag,
    describe_tag_conflict,
    explain,
    sequence_after,
    tag_sequence,
)
from colls.health import FailureRecord, GroupHealth
from colls.options import BackendOptions
from colls.store import HashStore, PrefixStore, TCPStore
from colls.work import Work
from colls_plugins.tcp._matching import MatchTable, RecvOp
from colls_plugins.tcp._mismatch import PROBE_TAG, Tracker, probe_field, probed_tag
from colls_plugins.tcp.backend import TcpBackend

WAIT = 10.0


class FakeBackend:
    """Records the hooks colls.health calls."""

    def __init__(self) -> None:
        self.aborted: BaseException | None = None
        self.listener = None

    def abort(self, error: BaseException) -> None:
        self.aborted = error

    def set_failure_listener(self, callback) -> None:
        self.listener = callback


def fake_group(store, name="g", ranks=(0, 1, 2), rank=0):
    backend = FakeBackend()
    pg = SimpleNamespace(name=name, global_ranks=tuple(ranks), rank=rank, backend=backend,
                         store=PrefixStore(name, store), global_rank=lambda r: ranks[r])
    pg.health = GroupHealth(pg)
    return pg


def _until(condition, limit=WAIT):
    deadline = time.monotonic() + limit
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


# -- fingerprints and tags ------------------------------------------------------------------------

def test_tags_keep_the_sequence_and_differ_by_signature():
    a = CallRecord("all_reduce", "float32", (4,), None, "SUM")
    b = CallRecord("broadcast", "float32", (4,), 0, None)
    c = CallRecord("all_reduce", "float32", (2, 2), None, "SUM")  # same numel
    for seq in (0, 1, 12345, (1 << SEQUENCE_BITS) - 1):
        tag = collective_tag(seq, a.signature())
        assert tag < 0 and tag_sequence(tag) == seq
    # the sequence number wraps; the tag stays clear of tcp's control-frame tags near -2**63
    assert tag_sequence(collective_tag(1 << SEQUENCE_BITS, a.signature())) == 0
    extreme = collective_tag((1 << SEQUENCE_BITS) - 1, (1 << SIGNATURE_BITS) - 1)
    assert PROBE_TAG < -(1 << 62) <= extreme < 0
    assert a.signature() != b.signature()
    assert a.signature() == c.signature()  # the tag checks element counts, not shapes
    message = describe_tag_conflict(collective_tag(3, a.signature()),
                                    collective_tag(3, b.signature()), 2)
    assert message == ("mismatched collectives: collective #3 is all_reduce on this rank but "
                       "broadcast on rank 2")


def test_sequence_numbers_compare_across_the_wrap():
    top = (1 << SEQUENCE_BITS) - 1
    assert sequence_after(5, 4) and not sequence_after(4, 5) and not sequence_after(4, 4)
    assert sequence_after(0, top) and sequence_after(3, top - 2) and not sequence_after(top, 0)
    moved_on = describe_tag_conflict(collective_tag(top, 0x0100000001),
                                     collective_tag(top + 1, 0x0100000001), 1)
    assert "rank 1 moved on to collective #0" in moved_on, moved_on


def test_signatures_of_equal_size_calls_differ_in_32_bits():
    """Calls that differ only in dtype (same bytes), reduce op or root get different 32-bit
    hashes, and over many distinct calls of one op the hashes never collide (a 16-bit hash
    would: 2,000 values collide with probability 1 - exp(-2000**2 / 2**17), about 1)."""
    base = CallRecord("all_reduce", "float32", (4,), None, "SUM")
    variants = [CallRecord("all_reduce", "int32", (4,), None, "SUM"),
                CallRecord("all_reduce", "float32", (4,), None, "MAX"),
                CallRecord("reduce", "float32", (4,), 1, "SUM")]
    assert all(v.signature() != base.signature() for v in variants)
    assert base.signature() >> 32 == 1  # the op code sits above the 32-bit hash
    hashes = {CallRecord("broadcast", "float32", (n,), root, None).signature()
              for n in range(1, 201) for root in range(10)}
    assert len(hashes) == 2000


def test_explain_names_the_odd_rank_against_the_majority():
    ok = "op=all_reduce;seq=1;dtype=float32;shape=(4,);root=-;reduce_op=SUM;group=g"
    odd = "op=all_reduce;seq=1;dtype=int32;shape=(4,);root=-;reduce_op=SUM;group=g"
    assert explain([ok, ok, ok]) is None
    assert explain([odd, ok, ok]) == "rank 0 differs: dtype=int32 where rank 1 has dtype=float32"
    assert issubclass(CollectiveMismatchError, ValueError)


# -- the tcp tracker ------------------------------------------------------------------------------

def _posted(table: MatchTable, src: int, tag: int) -> RecvOp:
    op = RecvOp(Work(), memoryview(bytearray(1)), src, tag)
    table.post(op)
    return op


def test_tracker_flags_another_tag_for_the_same_collective_number():
    tracker, table = Tracker(), MatchTable()
    mine, theirs = collective_tag(7, 0x010001), collective_tag(7, 0x020002)
    assert tracker.on_post(1, mine, now=0.0) is None
    op = _posted(table, 1, mine)
    stale, reason = tracker.on_arrival(2, theirs, False, table)
    assert stale == [op] and "collective #7" in reason and "rank 2" in reason
    assert tracker.on_post(1, mine, now=0.0) == reason  # later collective receives fail at once


def test_tracker_flags_a_peer_that_moved_on_and_ignores_peers_ahead():
    tracker, table = Tracker(), MatchTable()
    now = collective_tag(4, 0x010001)
    tracker.on_post(1, now, now=0.0)
    op = _posted(table, 1, now)
    assert tracker.on_arrival(2, collective_tag(5, 0x010001), False, table) == ([], "")
    stale, reason = tracker.on_arrival(1, collective_tag(5, 0x010001), False, table)
    assert stale == [op] and "moved on to collective #5" in reason


def test_tracker_probe_round_trip_and_schedule():
    tracker, table = Tracker(), MatchTable()
    mine = collective_tag(2, 0x010001)
    tracker.on_post(1, mine, now=100.0)
    _posted(table, 1, mine)
    assert tracker.wake_needed and tracker.next_probe == pytest.approx(100.5)
    assert tracker.due_probes(100.1, table) == []
    assert tracker.due_probes(100.6, table) == [(1, mine)]
    assert tracker.due_probes(101.0, table) == []  # once only
    assert probed_tag(probe_field(mine)) == mine and PROBE_TAG < mine
    peer, peer_table = Tracker(), MatchTable()
    other = collective_tag(2, 0x020002)
    peer.on_post(0, other, now=100.0)
    waiting = _posted(peer_table, 0, other)
    stale, reason, answer = peer.on_probe(0, mine, peer_table)
    assert stale == [waiting] and "collective #2" in reason
    assert answer == other  # probed back so that rank 0 learns of the conflict too


def test_user_tags_are_never_examined():
    tracker, table = Tracker(), MatchTable()
    assert tracker.on_post(1, 5, now=0.0) is None
    assert tracker.on_arrival(1, 6, False, table) == ([], "")


# -- tcp engine: mismatches fail fast without any group --------------------------------------

def _pair(**extra):
    store = HashStore()
    results: list = [None, None]

    def make(rank):
        opts = BackendOptions(timeout=20.0, group_name="u", global_ranks=(0, 1), extra=extra)
        results[rank] = TcpBackend(PrefixStore("u", store), rank, 2, opts)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
    return results


@pytest.mark.timeout(60)
def test_engine_fails_both_sides_of_a_silent_mismatch_through_probes(monkeypatch):
    monkeypatch.setenv("COLLS_SHM", "0")
    a, b = _pair()
    try:
        wa = a.irecv(np.zeros(1), 1, collective_tag(0, 0x010001))  # each waits for the other
        wb = b.irecv(np.zeros(1), 0, collective_tag(0, 0x020002))
        start = time.monotonic()
        for work in (wa, wb):
            with pytest.raises(BackendError, match="mismatched collectives"):
                work.wait(WAIT)
        assert time.monotonic() - start < 5.0  # probes go out after 0.5 s; WAIT is 10 s
    finally:
        a.close()
        b.close()


# -- colls.health ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_failure_recorded_by_one_process_breaks_the_group_elsewhere():
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        here, there = fake_group(master, rank=0), fake_group(client, ranks=(0, 1, 2), rank=1)
        raised = here.health.job_failed("all_reduce #3", CollsTimeoutError("too slow"))
        assert isinstance(raised, CollsTimeoutError)  # this rank sees its own error
        assert _until(lambda: there.health.error is not None)
        message = str(there.health.error)
        assert "rank 0 reported" in message and "all_reduce #3" in message
        # the error is visible before the abort that follows it: wait for that too
        assert _until(lambda: there.backend.aborted is not None)
        assert isinstance(there.backend.aborted, BackendError)
        with pytest.raises(BackendError, match="all_reduce: colls: group 'g' is broken"):
            there.health.check("all_reduce")
    finally:
        client.close()
        master.close()


@pytest.mark.timeout(60)
def test_a_dead_peer_breaks_every_group_that_contains_it():
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        world = fake_group(master, name="w", ranks=(0, 1, 2))
        with_2 = fake_group(client, name="a", ranks=(1, 2), rank=0)
        without_2 = fake_group(client, name="b", ranks=(0, 1), rank=1)
        pending = Work()
        world.health.track(pending)
        world.backend.listener(2, NetworkError("tcp: connection to rank 2 lost"))
        assert isinstance(pending.exception(), BackendError)
        assert "world rank 2 died or dropped its connection" in str(world.health.error)
        assert _until(lambda: with_2.health.error is not None)
        time.sleep(0.3)
        assert without_2.health.error is None
    finally:
        client.close()
        master.close()


def _held_on_the_watcher_thread(monkeypatch, method: str) -> tuple[threading.Event,
                                                                    threading.Event]:
    """Make the watcher thread stop in ``_Watcher.<method>`` until released; other threads (a
    catch-up) run it at once. Returns (the thread is held, release it)."""
    from colls import health as health_module

    holds, release = threading.Event(), threading.Event()
    original = getattr(health_module._Watcher, method)

    def held(self, argument):
        if threading.current_thread().name == "colls-health":
            holds.set()
            release.wait(WAIT)
        original(self, argument)

    monkeypatch.setattr(health_module._Watcher, method, held)
    return holds, release


@pytest.fixture
def record_held(monkeypatch):
    """Rank 0 of a group on two stores fails a collective and records why; rank 1's watcher
    has read the record but holds it, unapplied, until the test ends. Yields (rank 0, rank 1).

    That is the window in which a peer has left over a recorded failure and this rank has not
    learnt it from its watcher yet.
    """
    holds, release = _held_on_the_watcher_thread(monkeypatch, "_apply")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        here, there = fake_group(master, rank=0), fake_group(client, rank=1)
        here.health.job_failed("broadcast #0", ValueError("rank 0 runs a different collective"))
        assert holds.wait(WAIT)
        yield here, there
    finally:
        release.set()
        client.close()
        master.close()


@pytest.mark.timeout(60)
def test_a_lost_connection_finds_the_record_the_watcher_holds_but_has_not_applied(record_held):
    """The race CI once lost: a peer records why it fails, then closes its connections; this
    rank's watcher has read the record but not applied it when the collective sees the close.
    The collective's catch-up must still find the record and raise the peer's reason."""
    _, there = record_held
    raised = there.health.job_failed(
        "all_reduce #0", NetworkError("tcp: connection to rank 0 lost: peer closed"))
    assert isinstance(raised, BackendError)
    assert "rank 0 reported" in str(raised) and "different collective" in str(raised)


@pytest.mark.timeout(60)
def test_a_peer_that_left_over_a_recorded_failure_is_not_blamed_for_dying(record_held):
    """A rank that breaks closes its connections; a peer that sees one close (or a lazy
    connect reset) before its watcher applied the record must raise the record's reason, not
    "rank 0 died"."""
    _, there = record_held
    there.backend.listener(0, NetworkError("tcp: rank 1 cannot reach rank 0: reset"))
    message = str(there.health.error)
    assert "rank 0 reported" in message and "different collective" in message, message
    assert "died" not in message, message


@pytest.fixture
def store_loss_unseen(monkeypatch):
    """World rank 0, the store's host, has died; rank 1's watcher thread saw its parked request
    fail but holds that news, unapplied, until the test ends. Yields rank 1's group.

    That is the window in which a peer (breaking its own groups over the same loss) leaves and
    this rank sees it leave before its watcher has reported the store lost.
    """
    holds, release = _held_on_the_watcher_thread(monkeypatch, "_store_lost")
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        there = fake_group(client, rank=1)
        master.close()
        assert holds.wait(WAIT)
        yield there
    finally:
        release.set()
        client.close()
        master.close()


@pytest.mark.timeout(60)
def test_a_peer_lost_while_the_store_is_gone_is_blamed_on_the_store_host(store_loss_unseen):
    """The race CI once lost (rank 0 killed): rank 2 saw rank 1, which had broken its groups
    over rank 0's death, drop its connection before its own watcher reported the store lost.
    The catch-up finds the store unreachable: that, not rank 1, is the cause."""
    there = store_loss_unseen
    there.backend.listener(2, NetworkError("tcp: connection to rank 2 lost: reset"))
    message = str(there.health.error)
    assert "hosted by world rank 0, which probably died" in message, message
    assert "world rank 2" not in message, message


@pytest.mark.timeout(60)
def test_a_receive_from_a_peer_that_left_names_the_store_host_when_the_store_is_gone(
        store_loss_unseen):
    there = store_loss_unseen
    lost = NetworkError("tcp: connection to rank 2 lost: peer closed its backend")
    raised = there.health.explain("recv", lost)
    assert isinstance(raised, BackendError) and raised is not lost
    assert str(raised).startswith("recv: colls: group 'g' is broken: lost the connection to")
    assert "hosted by world rank 0" in str(raised)


@pytest.mark.timeout(60)
def test_a_receive_from_a_peer_that_left_in_order_keeps_its_error_and_the_group():
    """Nothing recorded, store alive: the peer just ended its program. A point-to-point call
    raises the transport's error and leaves the group usable (a collective needing the peer
    breaks it); after the store host's orderly shutdown the store's end is no cause either."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        host_side, other = fake_group(master), fake_group(client, rank=1)
        lost = NetworkError("tcp: connection to rank 2 lost: peer closed its backend")
        assert other.health.explain("recv", lost) is lost
        assert other.health.error is None
        host_side.health.close()  # the store host's last group: writes "shutdown"
        watcher = other.health._watcher
        assert _until(lambda: not watcher._thread.is_alive())
        master.close()
        assert other.health.explain("send", lost) is lost
        assert other.health.error is None
        not_lost = ValueError("a bad argument")
        assert other.health.explain("recv", not_lost) is not_lost
    finally:
        client.close()
        master.close()


@pytest.mark.timeout(60)
def test_a_record_written_before_a_process_attaches_its_first_group_still_breaks_it(
        monkeypatch):
    """A slow rank may still be setting up its world group when a fast one has already failed
    and recorded why: its watcher must not read that record before the group is attached."""
    from colls import health as health_module

    add = health_module._Watcher.add

    def slow_add(self, health):
        time.sleep(0.3)
        add(self, health)

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
    client = TCPStore("127.0.0.1", master.port, timeout=30)
    try:
        here = fake_group(master, rank=0)
        here.health.job_failed("all_reduce #0", ValueError("rank 0 failed first"))
        monkeypatch.setattr(health_module._Watcher, "add", slow_add)
        there = fake_group(client, rank=1)
        assert _until(lambda: there.health.error is not None)
        assert "rank 0 reported" in str(there.health.error)
    finally:
        client.close()
        master.close()


@pytest.mark.timeout(60)
def test_losing_the_store_breaks_groups_but_an_orderly_shutdown_does_not():
    for orderly in (True, False):
        master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
        client = TCPStore("127.0.0.1", master.port, timeout=30)
        try:
            host_side, other = fake_group(master), fake_group(client, rank=1)
            if orderly:
                host_side.health.close()  # the store host's last group: writes "shutdown"
                # As destroy_process_group's linger does: the server stays up until the peer's
                # watcher has read the record. Closed at once, it could drop the watcher's
                # request unread (a reset the peer takes for a dead host; one CI run in many).
                watcher = other.health._watcher
                assert _until(lambda w=watcher: not w._thread.is_alive())
            master.close()
            if orderly:
                time.sleep(0.5)
                assert other.health.error is None
            else:
                health = other.health
                assert _until(lambda h=health: h.error is not None)
                assert "hosted by world rank 0" in str(health.error)
        finally:
            client.close()
            master.close()


def test_failure_records_are_json_and_malformed_ones_are_ignored():
    record = FailureRecord("failed", "g", 1, 3, "broadcast #2", "boom")
    assert FailureRecord.decode(record.encode()) == record
    assert FailureRecord.decode(b"\x80not json") is None
    assert FailureRecord.decode(b'{"kind": "failed", "evil": 1}') is None
