"""Point-to-point of the tcp backend: dtypes, sizes, tag matching, any-source, unexpected."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from _support import on_threads

from colls.errors import BackendError, CollsTimeoutError

DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]
SIZES_BYTES = [0, 1, 1000, 8 << 20]
WAIT = 20.0


def pattern(dtype: str, count: int, seed: int) -> np.ndarray:
    """Return a deterministic array of ``count`` elements of ``dtype`` that depends on ``seed``."""
    raw = np.random.default_rng(seed).integers(0, 256, size=count * np.dtype(dtype).itemsize,
                                               dtype=np.uint8)
    if dtype == "bool":
        return (raw % 2).astype(bool)
    return raw.view(dtype).copy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_and_size_between_all_pairs(group, dtype):
    world = 3
    backends = group(world)
    itemsize = np.dtype(dtype).itemsize
    counts = sorted({max(size // itemsize, 1) if size else 0 for size in SIZES_BYTES})

    def body(rank):
        sends, recvs = [], []
        for count, peer in itertools.product(counts, range(world)):
            if peer == rank:
                continue
            seed = hash((rank, peer, count)) & 0xFFFF
            sends.append(backends[rank].isend(pattern(dtype, count, seed), peer, count))
            out = np.zeros(count, dtype)
            expected = pattern(dtype, count, hash((peer, rank, count)) & 0xFFFF)
            recvs.append((backends[rank].irecv(out, peer, count), out, expected, peer))
        for work in sends:
            work.wait(WAIT)
        for work, out, expected, peer in recvs:
            assert work.result() == peer
            np.testing.assert_array_equal(out, expected)

    on_threads(body, world)


@pytest.mark.timeout(60)
def test_tags_match_in_fifo_order_per_tag_whatever_the_receive_order(group):
    a, b = group(2)
    tags = [0, 1, 2, 7, 1 << 40, -5]
    messages = [(tag, i) for i in range(20) for tag in tags]  # interleaved tags
    sends = [a.isend(np.array([tag % 1000, i], np.int64), 1, tag) for tag, i in messages]
    received = {}
    for tag in reversed(tags):  # receive tag by tag, in the opposite order
        for i in range(20):
            out = np.zeros(2, np.int64)
            assert b.irecv(out, 0, tag).result() == 0
            received[(tag, i)] = out.tolist()
    for work in sends:
        work.wait(WAIT)
    assert received == {(tag, i): [tag % 1000, i] for tag, i in messages}


@pytest.mark.timeout(60)
def test_posted_receives_complete_in_order_with_mixed_tags(group):
    a, b = group(2)
    outs = {(tag, i): np.zeros(4, np.int32) for i in range(10) for tag in (3, 9)}
    works = {key: b.irecv(out, 0, key[0]) for key, out in outs.items()}  # posted first
    for i in range(10):
        for tag in (9, 3):
            a.isend(np.full(4, tag * 100 + i, np.int32), 1, tag)
    for key, work in works.items():
        assert work.result() == 0
        assert outs[key].tolist() == [key[0] * 100 + key[1]] * 4


@pytest.mark.timeout(60)
def test_any_source_receive_returns_the_sender(group):
    backends = group(4)
    outs = [np.zeros(8, np.float32) for _ in range(3)]
    works = [backends[0].irecv(out, None, 11) for out in outs]
    for rank in (3, 1, 2):
        backends[rank].isend(np.full(8, rank, np.float32), 0, 11).wait(WAIT)
        time.sleep(0.05)  # keep arrival order deterministic
    senders = [work.result() for work in works]
    assert senders == [3, 1, 2]
    for sender, out in zip(senders, outs, strict=True):
        assert (out == sender).all()


@pytest.mark.timeout(60)
def test_any_source_and_specific_receives_match_in_posting_order(group):
    a, b = group(2)
    first, second = np.zeros(1, np.int64), np.zeros(1, np.int64)
    w_any = b.irecv(first, None, 4)
    w_specific = b.irecv(second, 0, 4)
    a.isend(np.array([1]), 1, 4)
    a.isend(np.array([2]), 1, 4)
    assert w_any.result() == 0 and w_specific.result() == 0
    assert (first[0], second[0]) == (1, 2)


@pytest.mark.timeout(60)
def test_unexpected_messages_are_kept_until_a_receive_is_posted(group):
    a, b, c = group(3)
    big = pattern("float64", 1 << 20, 1)
    a.isend(big, 1, 5).wait(WAIT)
    c.isend(np.arange(3, dtype=np.int16), 1, 6).wait(WAIT)
    a.isend(np.zeros(0, np.uint8), 1, 7).wait(WAIT)
    time.sleep(0.3)  # let everything arrive before any receive exists
    empty = np.zeros(0, np.uint8)
    assert b.irecv(empty, 0, 7).wait(0.5)  # already here: completes at once
    out = np.zeros(3, np.int16)
    work = b.irecv(out, None, 6)
    assert work.is_completed() and work.result() == 2
    assert out.tolist() == [0, 1, 2]
    got = np.zeros_like(big)
    assert b.irecv(got, 0, 5).result() == 0
    np.testing.assert_array_equal(got, big)


@pytest.mark.timeout(60)
def test_size_mismatch_fails_the_receive_and_keeps_the_stream_in_sync(group):
    a, b = group(2)
    small = np.zeros(10, np.float32)
    work = b.irecv(small, 0, 3)  # posted: 40 bytes
    a.isend(np.ones(1000, np.float32), 1, 3)  # 4000 bytes
    with pytest.raises(BackendError) as info:
        work.wait(WAIT)
    message = str(info.value)
    for part in ("tcp recv from rank 0 tag 3", "from rank 0", "tag 3", "4000 bytes", "40 bytes"):
        assert part in message
    # the body was drained: the next message on the stream is intact
    a.isend(np.arange(5, dtype=np.int64), 1, 3)
    out = np.zeros(5, np.int64)
    assert b.irecv(out, 0, 3).result() == 0 and out.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_size_mismatch_of_an_unexpected_message(group):
    a, b = group(2)
    a.isend(np.ones(6, np.int8), 1, 2).wait(WAIT)
    time.sleep(0.2)
    with pytest.raises(BackendError, match="has 6 bytes but the receive buffer has 8 bytes"):
        b.irecv(np.zeros(1, np.int64), None, 2).wait(WAIT)


@pytest.mark.timeout(60)
def test_isend_of_a_large_array_does_not_block_the_caller(group):
    a, b = group(2)
    big = np.ones(64 << 20, np.uint8)  # far more than the kernel buffers hold
    start = time.monotonic()
    work = a.isend(big, 1, 0)
    # a blocking isend would wait for the receive that is only posted below; generous bound
    assert time.monotonic() - start < 5.0
    time.sleep(0.2)
    out = np.zeros_like(big)
    assert b.irecv(out, 0, 0).result() == 0  # the receiver posts only now
    assert work.wait(WAIT)
    assert out.all()


@pytest.mark.timeout(60)
def test_many_small_messages_and_concurrent_senders(group):
    a, b = group(2)
    count = 300

    def sender(tag):
        return [a.isend(np.full(i % 50 + 1, i, np.int32), 1, tag) for i in range(count)]

    results = {}
    threads = [threading.Thread(target=lambda t=t: results.__setitem__(t, sender(t)))
               for t in (1, 2)]
    for t in threads:
        t.start()
    for tag in (2, 1):
        for i in range(count):
            out = np.zeros(i % 50 + 1, np.int32)
            assert b.irecv(out, 0, tag).result() == 0
            assert (out == i).all()
    for t in threads:
        t.join(WAIT)
    for works in results.values():
        assert all(w.wait(WAIT) for w in works)


@pytest.mark.timeout(60)
def test_send_to_self_is_delivered_locally(group):
    (a, b) = group(2)
    out = np.zeros(3)
    a.isend(np.array([1.0, 2.0, 3.0]), 0, 9).wait(WAIT)
    assert a.irecv(out, None, 9).result() == 0
    assert out.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.timeout(60)
def test_world_size_one_needs_no_socket(group):
    (solo,) = group(1)
    assert solo._engine._thread is None and not solo._engine._peers
    out = np.zeros(2, np.int8)
    work = solo.irecv(out, 0, 1)
    solo.isend(np.array([4, 5], np.int8), 0, 1).wait(WAIT)
    assert work.result() == 0 and out.tolist() == [4, 5]


@pytest.mark.timeout(60)
def test_bad_arguments_name_the_argument(group):
    a, _ = group(2)
    with pytest.raises(ValueError, match=r"tcp isend: dst must be in \[0, 2\), got 2"):
        a.isend(np.zeros(1), 2, 0)
    with pytest.raises(ValueError, match=r"tcp irecv: src must be in \[0, 2\), got -1"):
        a.irecv(np.zeros(1), -1, 0)
    with pytest.raises(TypeError, match="tcp isend: tag must be an int, got str"):
        a.isend(np.zeros(1), 1, "x")
    with pytest.raises(ValueError, match="tcp isend: tag must be in"):
        a.isend(np.zeros(1), 1, -(1 << 63))
    with pytest.raises(ValueError, match="must be C-contiguous"):
        a.isend(np.zeros(10)[::2], 1, 0)
    readonly = np.zeros(3)
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="read-only"):
        a.irecv(readonly, 1, 0)


@pytest.mark.timeout(60)
def test_dtypes_without_a_buffer_export_move_as_bytes(group):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a, b = group(2)
    data = np.linspace(-3, 3, 1001).astype(ml_dtypes.bfloat16)
    out = np.zeros_like(data)
    work = b.irecv(out, 0, 0)
    a.isend(data, 1, 0).wait(WAIT)
    assert work.result() == 0
    assert out.view(np.uint16).tolist() == data.view(np.uint16).tolist()


@pytest.mark.timeout(60)
def test_a_receive_wait_ends_at_its_timeout_not_twice_it(group):
    """A host peer's receive polls the rings before it waits; the two share one timeout."""
    backends = group(2)
    out = np.zeros(4)
    work = backends[0].irecv(out, 1, 5)
    start = time.monotonic()
    with pytest.raises(CollsTimeoutError):
        work.wait(1.0)
    elapsed = time.monotonic() - start
    assert 0.9 < elapsed < 1.6, elapsed  # the bug waited the whole timeout twice (2.0 s)
    backends[1].isend(np.arange(4.0), 0, 5).wait(WAIT)
    work.wait(WAIT)
    assert work.result() == 1
    np.testing.assert_array_equal(out, np.arange(4.0))
