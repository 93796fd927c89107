"""The tcp backend's shared-memory path: selection, results, failures and cleanup."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import multiprocessing
import os
import resource
import signal
import socket
import sys
import threading
import time

import numpy as np
import pytest
import shm_workers
from _support import on_threads
from tcp_helpers import NEEDS_SHM

from colls import dtypes, fingerprint
from colls.errors import BackendError, CollsTimeoutError
from colls.reduce_ops import ReduceOp, resolve_op
from colls.store import HashStore
from colls.testing.spawn import free_port, spawn
from colls_plugins.tcp.shm import group as shm_group
from colls_plugins.tcp.shm import native as shm_native
from colls_plugins.tcp.shm import segment as shm_segment
from colls_plugins.tcp.shm import setup as shm_setup

#: Small slots (4 KiB) so that a few thousand elements take the multi-piece paths.
SMALL_SLOTS = {"COLLS_SEGMENT_BYTES": "4096"}

pytestmark = NEEDS_SHM

SUM_F64 = resolve_op(ReduceOp.SUM, dtypes.FLOAT64, op_name="all_reduce")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "tcp"])
def test_all_reduce_every_dtype(world, use_shm):
    env = {**SMALL_SLOTS, "COLLS_SHM": "1" if use_shm else "0"}
    digests = spawn(shm_workers.all_reduce_every_dtype, world, args=(use_shm,), env=env,
                    timeout=180)
    runs = sum(1 if d.is_complex else 2 for d in dtypes.DTYPES) * len(shm_workers.COUNTS)
    assert len(digests[0]) == runs  # every dtype (bfloat16 too), op and count ran
    assert all(d == digests[0] for d in digests), "ranks ended with different bytes"


@pytest.mark.timeout(120)
def test_other_collectives_through_shm(shm_path):
    checks = spawn(shm_workers.other_collectives, 3, args=(True, shm_path),
                   env={**SMALL_SLOTS, "COLLS_NATIVE": str(int(shm_path))}, timeout=90)
    assert checks == [28, 28, 28]


def test_shm_is_chosen_on_one_host_and_off_with_colls_shm_0(group, monkeypatch):
    backends = group(2, name="on")
    assert [b.uses_shm for b in backends] == [True, True]
    monkeypatch.setenv("COLLS_SHM", "0")
    assert [b.uses_shm for b in group(2, name="off")] == [False, False]


def test_one_rank_with_colls_shm_0_keeps_the_whole_group_on_tcp(group, monkeypatch):
    real = shm_setup.shm_supported
    calls = []

    def only_rank_one_refuses() -> str | None:
        calls.append(1)
        return "COLLS_SHM=0" if len(calls) == 2 else real()

    monkeypatch.setattr(shm_setup, "shm_supported", only_rank_one_refuses)
    backends = group(2, name="mixed")
    assert [b.uses_shm for b in backends] == [False, False]
    arrays = [np.arange(10.0) * (r + 1) for r in range(2)]
    on_threads(lambda r: backends[r].all_reduce(arrays[r], SUM_F64, -1), 2)
    np.testing.assert_array_equal(arrays[0], np.arange(10.0) * 3)


def test_a_second_group_on_the_same_store_and_name_sets_up_afresh(group):
    store = HashStore()
    first = group(2, store=store, name="again")
    for backend in first:
        backend.close()
    second = group(2, store=store, name="again")
    assert [b.uses_shm for b in second] == [True, True]
    arrays = [np.full(5, r + 1.0) for r in range(2)]
    on_threads(lambda r: second[r].all_reduce(arrays[r], SUM_F64, -1), 2)
    np.testing.assert_array_equal(arrays[0], np.full(5, 3.0))


@pytest.mark.parametrize(("world", "direct_max"), [(2, None), (5, None), (5, 4)])
def test_the_shared_memory_setup_leaves_no_key_behind(group, world, direct_max, monkeypatch):
    """Both rounds' keys go, in one request by the last host rank to read (not one each), on a
    host small enough to read its values directly and on one that gathers them through its
    first rank."""
    if direct_max is not None:
        monkeypatch.setattr(shm_setup, "DIRECT_MAX_RANKS", direct_max)
    direct = world <= shm_setup.DIRECT_MAX_RANKS
    store = HashStore()
    deletes: list[int] = []
    delete_keys = store._delete_keys  # what the group's PrefixStore calls

    def counted(keys: list[str]) -> int:
        deletes.append(len(keys))
        return delete_keys(keys)

    store._delete_keys = counted  # type: ignore[method-assign]
    backends = group(world, store=store, name="tidy")
    assert all(b.uses_shm for b in backends)
    # one delete of the host identities, one of the map, one of both shared-memory rounds:
    # directly read, each rank's info and answer and the count; gathered, each rank's but the
    # first rank's, both combined values and the count
    rounds = 2 * world + 1 if direct else 2 * (world - 1) + 3
    assert sorted(deletes) == sorted([world - 1, 2, rounds])
    leftover = [k for k in store._data if "tcp/host" in k or "tcp/shm" in k]
    assert leftover == [], leftover


def test_algorithm_override_bypasses_shm(group, monkeypatch):
    backends = group(2, name="forced")
    monkeypatch.setenv("COLLS_ALGORITHM", "all_reduce=ring")
    assert backends[0]._shm_for("all_reduce") is None
    assert backends[0]._shm_for("broadcast") is not None
    arrays = [np.arange(1000.0) * (r + 1) for r in range(2)]
    on_threads(lambda r: backends[r].all_reduce(arrays[r], SUM_F64, -1), 2)
    np.testing.assert_array_equal(arrays[1], np.arange(1000.0) * 3)


@pytest.mark.timeout(60)
def test_mismatched_collectives_raise_instead_of_mixing_data(group, shm_path):
    """The shm path compares the tags (sequence number and signature) that colls gives calls."""
    backends = group(2, name="mismatch")
    assert (backends[0]._shm.native is not None) == shm_path
    arrays = [np.zeros(8), np.zeros(16)]
    tags = [
        fingerprint.collective_tag(
            0, fingerprint.CallRecord("all_reduce", "float64", a.shape, None, "SUM").signature())
        for a in arrays
    ]

    def body(rank):
        with pytest.raises(BackendError, match=f"mismatched collectives: collective #0 "
                           f"\\(all_reduce\\) was called with a different .* on rank {1 - rank}"):
            backends[rank].all_reduce(arrays[rank], SUM_F64, tags[rank])
        return True

    assert on_threads(body, 2) == [True, True]


@pytest.mark.timeout(60)
def test_missing_rank_times_out_with_its_rank_named(group, shm_path):
    backends = group(2, name="late", timeout=1.0)
    assert (backends[0]._shm.native is not None) == shm_path
    start = time.monotonic()
    with pytest.raises(CollsTimeoutError, match=r"no progress from ranks \[1\]"):
        backends[0].barrier(-1)
    assert time.monotonic() - start < 10


def _dev_shm() -> set[str]:
    """Names in /dev/shm, less the semaphores of multiprocessing queues and MPICH's segments
    (other tests on the host create those)."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if not n.startswith(("sem.", "mpich"))}


def _segment_inodes(pid: int) -> set[int]:
    """Return the inodes of the colls segments process ``pid`` maps (from /proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return {int(line.split()[4]) for line in maps if "colls-tcp-shm" in line}


def _mapped_anywhere(inodes: set[int]) -> set[int]:
    """Return which of ``inodes`` some process on this host still maps."""
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found |= _segment_inodes(int(entry)) & inodes
            except OSError:  # it exited meanwhile, or is not ours to read
                continue
    return found


@pytest.mark.timeout(120)
def test_sigkill_leaves_no_segment_and_fails_the_survivor_fast(shm_path):
    before = _dev_shm()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()  # rank 0 hosts the TCPStore (env://)
    procs = [ctx.Process(target=shm_workers.hold_group, args=(r, port, results))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        ready = sorted(results.get(timeout=60) for _ in procs)
        # both ranks used shared memory (mapped segments) and got the right sum
        assert [(r[0], r[1], r[3], r[5], r[6]) for r in ready] == [
            ("ready", 0, True, 3.0, shm_path), ("ready", 1, True, 3.0, shm_path)]
        assert all(r[4] >= 2 for r in ready), ready  # own segment and the peer's are mapped
        assert _dev_shm() - before == set(), "segments must not have names in /dev/shm"
        segments = [_segment_inodes(p.pid) for p in procs]
        assert segments[0] == segments[1] and len(segments[0]) == 2, segments  # both, by both
        time.sleep(0.5)  # rank 0 is now blocked in a shared-memory barrier
        killed_at = time.time()
        os.kill(procs[1].pid, signal.SIGKILL)
        kind, rank, when, message = results.get(timeout=30)
        assert (kind, rank) == ("error", 0), message
        # NetworkError from the backend, or the group-level BackendError that wraps it
        assert "rank 1" in message and ("lost" in message or "died" in message), message
        assert when - killed_at < 5.0, f"the survivor failed {when - killed_at:.1f} s after"
        os.kill(procs[0].pid, signal.SIGKILL)
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert _dev_shm() - before == set()
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2
    # the kernel freed the segments with the processes: no process maps them any more
    assert _mapped_anywhere(segments[0]) == set()


def test_segment_is_anonymous_and_peers_map_it_read_only(shm_path):
    native = shm_native.load()
    seg = shm_segment.Segment.create(4096, token=1234)
    try:
        assert os.readlink(f"/proc/self/fd/{seg.fd}").startswith("/memfd:colls-tcp-shm")
        peer = shm_segment.Segment.open_peer(os.getpid(), seg.fd, 4096, token=1234, native=native)
        try:
            byte = np.dtype(np.uint8)
            seg.typed(0, byte)[:4] = [1, 2, 3, 4]
            assert list(peer.typed(0, byte)[:4]) == [1, 2, 3, 4]
            with pytest.raises(ValueError):
                peer.typed(0, byte)[0] = 9
            with pytest.raises((TypeError, BufferError)):  # no writable view of it either
                memoryview(peer.mm).cast("q")[0] = 9
            assert list(seg.typed(0, byte)[:4]) == [1, 2, 3, 4]
        finally:
            peer.close()
        with pytest.raises(ValueError, match="token"):
            shm_segment.Segment.open_peer(os.getpid(), seg.fd, 4096, token=99, native=native)
    finally:
        seg.close()


def test_a_mapped_peer_segment_holds_no_descriptor_where_it_can(shm_path):
    """The compiled mapping keeps no descriptor on any Python; mmap keeps one before 3.13.

    A rank of a 256-rank host maps 255 peers: one descriptor each would be 255 per rank.
    """
    native = shm_native.load()
    segments = [shm_segment.Segment.create(4096, token=7, ranks=3) for _ in range(3)]
    try:
        before = len(os.listdir("/proc/self/fd"))
        peers = [shm_segment.Segment.open_peer(os.getpid(), s.fd, 4096, token=7, ranks=3,
                                               native=native)
                 for s in segments]
        held = len(os.listdir("/proc/self/fd")) - before
        expected = 0 if native is not None or sys.version_info >= (3, 13) else 3
        assert held == expected
        for seg, peer in zip(segments, peers, strict=True):
            seg.pair(1)[0][0] = 12345  # the owner writes, the peer's view sees it
            assert peer.pair(1)[0][0] == 12345
            ring = peer.pair(2)[1]
            with pytest.raises(BufferError):  # a view is alive: the mapping stays
                peer.mm.close()
            ring.release()
        for peer in peers:
            peer.close()
    finally:
        for seg in segments:
            seg.close()


def test_a_segment_is_sealed_against_resizing():
    seg = shm_segment.Segment.create(4096, token=1234)
    try:
        size = os.fstat(seg.fd).st_size
        for wrong in (size // 2, size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(seg.fd, wrong)  # a shrink would SIGBUS every rank that maps it
        assert os.fstat(seg.fd).st_size == size
        with pytest.raises(PermissionError):  # nor can the seals be changed
            fcntl.fcntl(seg.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    finally:
        seg.close()


def test_an_unsealed_segment_is_not_mapped(shm_path):
    size = shm_segment.Segment.size_for(4096)
    fd = os.memfd_create("colls-tcp-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:  # a segment in every other respect
            words = memoryview(mm)[: shm_segment.CTRL_BYTES].cast("q")
            words[0], words[1] = 0x434F4C4C5353484D, 1234
            words.release()
        with pytest.raises(ValueError, match=r"segment of pid \d+ is not sealed against resizing"):
            shm_segment.Segment.open_peer(os.getpid(), fd, 4096, token=1234,
                                          native=shm_native.load())
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
def test_one_sleep_reads_a_bounded_number_of_wake_ups(group):
    """A waiter's drain loop ends although datagrams keep coming (anyone on the host can send)."""
    waiter = group(2, name="flood")[0]._shm
    address = waiter._wake_sock.getsockname()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
        queued = 0
        with contextlib.suppress(BlockingIOError):
            while True:
                sender.sendto(b"\0", socket.MSG_DONTWAIT, address)
                queued += 1
    if queued <= shm_group.WAKE_DRAIN_MAX:
        pytest.skip(f"the kernel queues only {queued} datagrams (net.unix.max_dgram_qlen)")
    waiter._sleep(0.0)
    left = 0
    with contextlib.suppress(BlockingIOError):
        while waiter._wake_sock.recv(64):
            left += 1
    assert left == queued - shm_group.WAKE_DRAIN_MAX


def _two_rank_group(timeout: float, peer_error=lambda r: None) -> tuple[shm_group.ShmGroup, list]:
    """Rank 0's view of two segments of this process, waiting as a separate process would
    (spin, then yield, then block); the test writes rank 1's words itself."""
    segments = [shm_segment.Segment.create(4096, token=7) for _ in range(2)]
    group = shm_group.ShmGroup(0, segments, 4096, None, [None, None], same_process=False,
                         timeout=timeout, peer_error=peer_error)
    return group, segments


@pytest.mark.timeout(60)
def test_a_waiter_that_spins_and_yields_still_times_out_or_reports_a_dead_peer(shm_path):
    group, segments = _two_rank_group(timeout=0.5)
    try:
        assert (group.native is not None) == shm_path
        start = time.monotonic()
        with pytest.raises(CollsTimeoutError, match=r"rank 0: barrier \(shm\) did not complete "
                           r"within 0.5 s \(shared memory; no progress from ranks \[1\]\)"):
            group.wait_all(1, "barrier (shm)")
        assert 0.5 <= time.monotonic() - start < 10
    finally:
        group.close()
    dead = ConnectionError("rank 1 died")
    group, segments = _two_rank_group(timeout=30.0, peer_error=lambda r: dead)
    try:
        with pytest.raises(ConnectionError, match="rank 1 died"):
            group.wait_all(1, "barrier (shm)")
        segments[1].ctrl[shm_segment.W_SEQ] = 1  # rank 1 posts its phase: the wait returns at once
        group.wait_all(1, "barrier (shm)")
    finally:
        group.close()


@pytest.mark.timeout(60)
def test_a_waiter_blocks_on_a_wake_socket_numbered_past_fd_setsize(shm_path):
    """select() refuses descriptors from 1024 (FD_SETSIZE) on; a process holding many sockets
    (the store host of a thousand-rank job) has its wake-up socket there."""
    high = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= high:
        pytest.skip(f"descriptors are limited to {hard} here: none can be numbered {high}")
    if soft != resource.RLIM_INFINITY and soft <= high:
        resource.setrlimit(resource.RLIMIT_NOFILE, (high + 1, hard))
    mine, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    os.dup2(mine.fileno(), high)
    mine.close()
    wake = socket.socket(fileno=high)
    wake.setblocking(False)
    segments = [shm_segment.Segment.create(4096, token=7) for _ in range(2)]
    group = shm_group.ShmGroup(0, segments, 4096, wake, [None, None], same_process=False,
                         timeout=0.5, peer_error=lambda r: None)
    try:
        other.send(b"\0")  # a wake-up that ends one sleep early: read, then block again
        with pytest.raises(CollsTimeoutError, match=r"no progress from ranks \[1\]"):
            group.wait_all(1, "barrier (shm)")
    finally:
        group.close()  # closes the wake-up socket
        other.close()
        if soft != resource.RLIM_INFINITY and soft <= high:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crowded", [False, True])
def test_polling_starts_short_on_a_crowded_host_and_shrinks_after_blocking(
        shm_path, crowded, monkeypatch):
    """With a few ranks per core a waiter polls up to YIELD_SECONDS_MAX at first; with more
    than CROWDED_RANKS_PER_CORE, YIELD_SECONDS_CROWDED (the ranks it waits for may be working on
    the cores it would take). Waits that end blocked halve the budget down to the floor."""
    cores = 1 if crowded else 2  # the group has two ranks: 2 per core is not crowded
    monkeypatch.setattr(shm_group, "available_cores", lambda: cores)
    monkeypatch.setattr(shm_group, "CROWDED_RANKS_PER_CORE", 1)
    group, segments = _two_rank_group(timeout=30.0)
    floor = shm_group.YIELD_SECONDS_CROWDED if crowded else shm_group.YIELD_SECONDS_MIN
    start = floor if crowded else shm_group.YIELD_SECONDS_MAX
    try:
        assert group._yield_budget == start
        budgets = []
        for phase in range(1, 4):  # rank 1 posts long after the budget: every wait blocks
            poster = threading.Timer(
                start + 0.2, lambda p=phase: segments[1].ctrl.__setitem__(shm_segment.W_SEQ, p))
            poster.start()
            group.wait_all(phase, "barrier (shm)")
            poster.join()
            budgets.append(group._yield_budget)
        expected = [max(floor, start / 2 ** k) for k in (1, 2, 3)]
        assert budgets == pytest.approx(expected)
    finally:
        group.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm_path", ["native"], indirect=True)
def test_the_compiled_wait_yields_without_the_gil(shm_path):
    """Another thread of the process runs while the compiled poll yields (it posts for rank 1)."""
    group, segments = _two_rank_group(timeout=30.0)
    try:
        peer = segments[1].ctrl
        assert group.native.poll([1], 1, 0.0, 0.01) == 2  # nobody posted: the budget ends
        poster = threading.Timer(0.05, lambda: peer.__setitem__(shm_segment.W_SEQ, 1))
        poster.start()
        assert group.native.poll([1], 1, 0.0, 5.0) == 1  # reached while yielding
        poster.join()
        assert group.native.poll([1], 1, 0.001, 0.0) == 0  # already there
        group.close()
        with pytest.raises(ValueError, match="the group's shared memory is closed"):
            group.native.poll([1], 1, 0.0, 0.0)
    finally:
        group.close()


def _three_rank_group(rank: int) -> tuple[shm_group.ShmGroup, list[shm_segment.Segment]]:
    """Host rank ``rank``'s view of three segments of this process, blocking at once (as ranks
    on threads do); the test writes the other ranks' words itself."""
    segments = [shm_segment.Segment.create(4096, token=7) for _ in range(3)]
    group = shm_group.ShmGroup(rank, segments, 4096, None, [None] * 3, same_process=True,
                         timeout=30.0, peer_error=lambda r: None)
    return group, segments


@pytest.mark.timeout(60)
def test_a_post_wakes_only_the_sleepers_that_wait_for_the_poster(shm_path, monkeypatch):
    """Rank 1 posts: it wakes rank 0, asleep until rank 1 posts, but not rank 2, asleep until
    rank 0 posts (every post woke every sleeper: L^2 wake-ups for L ranks in a barrier)."""
    group, segments = _three_rank_group(rank=1)
    woken: list[int] = []
    monkeypatch.setattr(group, "_wake", woken.append)
    try:
        assert (group.native is not None) == shm_path
        segments[0].ctrl[shm_segment.W_SLEEP] = shm_segment.SLEEPS_FOR + 1
        segments[2].ctrl[shm_segment.W_SLEEP] = shm_segment.SLEEPS_FOR + 0
        group.post()
        assert woken == [0]
        segments[0].ctrl[shm_segment.W_SLEEP] = shm_segment.AWAKE
        group.post()
        assert woken == [0]
    finally:
        group.close()


@pytest.mark.timeout(60)
def test_a_sleeper_waits_for_one_pending_rank_at_a_time(shm_path):
    """Rank 0 blocks until ranks 1 and 2 post phase 1: its sleep word names rank 2 (the last
    pending), then rank 1 once rank 2 has posted, and says awake once both have."""
    group, segments = _three_rank_group(rank=0)
    sleep_word = segments[0].ctrl

    def sleeps_for(rank: int) -> bool:
        deadline = time.monotonic() + 10
        while sleep_word[shm_segment.W_SLEEP] != shm_segment.SLEEPS_FOR + rank:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    waiter = threading.Thread(target=group.wait_all, args=(1, "barrier (shm)"))
    try:
        waiter.start()
        assert sleeps_for(2)
        segments[2].ctrl[shm_segment.W_SEQ] = 1  # no wake-up sent: the sleeper's next look sees it
        assert sleeps_for(1)
        segments[1].ctrl[shm_segment.W_SEQ] = 1
        waiter.join(10)
        assert not waiter.is_alive()
        assert sleep_word[shm_segment.W_SLEEP] == shm_segment.AWAKE
    finally:
        segments[1].ctrl[shm_segment.W_SEQ] = segments[2].ctrl[shm_segment.W_SEQ] = 1
        waiter.join(10)
        group.close()
