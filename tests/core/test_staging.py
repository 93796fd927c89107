"""The staging pipeline of colls.staging, with the device's copy engines played by threads.

No GPU is needed: colls.testing.staging's ThreadCopier copies on two worker threads, so the
pipeline's overlap and its ordering rules run for real. The CuPy copier runs only in tests/gpu.
"""

from __future__ import annotations

import numpy as np
import pytest

from colls import staging
from colls.staging import PIPELINE_DEPTH, run_segmented, segment_bounds
from colls.testing.staging import StandInDeviceArray, ThreadCopier


def _host_buffers(largest: int) -> list[np.ndarray]:
    return [np.zeros(largest, dtype=np.uint8) for _ in range(PIPELINE_DEPTH)]


@pytest.mark.parametrize(
    ("nbytes", "itemsize", "segment", "expected"),
    [
        (0, 4, 16, []),
        (12, 4, 16, [(0, 12)]),
        (40, 4, 16, [(0, 16), (16, 16), (32, 8)]),
        (40, 8, 20, [(0, 16), (16, 16), (32, 8)]),  # whole elements: 20 B rounds down to 16
        (24, 8, 4, [(0, 8), (8, 8), (16, 8)]),  # a segment smaller than an element: one element
    ],
)
def test_segments_hold_whole_elements(nbytes, itemsize, segment, expected):
    assert segment_bounds(nbytes, itemsize, segment) == expected


@pytest.mark.parametrize("count", [1, 7, 64, 1000])
def test_every_segment_comes_back_transformed(count):
    data = np.arange(count, dtype=np.float64)
    device = data.copy()
    copier = ThreadCopier(device)
    segments = segment_bounds(device.nbytes, 8, 64)
    seen = []

    def transport(host: np.ndarray, k: int) -> None:
        seen.append(k)
        host.view(np.float64)[:] *= 3

    run_segmented(copier, _host_buffers(64), segments, transport, download=True, upload=True)
    np.testing.assert_array_equal(device, data * 3)
    assert seen == list(range(len(segments)))
    assert copier.violations == []
    assert copier.finished


def test_the_next_copy_down_starts_before_this_segments_transport():
    device = np.arange(40, dtype=np.int32)
    copier = ThreadCopier(device)
    segments = segment_bounds(device.nbytes, 4, 16)
    marks = []

    def transport(host: np.ndarray, k: int) -> None:
        marks.append(list(copier.log))

    run_segmented(copier, _host_buffers(16), segments, transport, download=True, upload=True)
    for k in range(len(segments) - 1):
        assert ("download", segments[k + 1][0]) in marks[k], (k, marks[k])


def test_a_buffer_is_reused_only_after_its_copy_up():
    device = np.arange(4096, dtype=np.uint8)
    copier = ThreadCopier(device)
    segments = segment_bounds(device.nbytes, 1, 64)  # 64 segments over 3 buffers
    run_segmented(copier, _host_buffers(64), segments, lambda host, k: None,
                  download=True, upload=True)
    assert copier.violations == []
    np.testing.assert_array_equal(device, np.arange(4096, dtype=np.uint8))


def test_a_receiver_reads_nothing_and_a_sender_writes_nothing():
    device = np.full(100, 7, dtype=np.int64)
    copier = ThreadCopier(device)
    segments = segment_bounds(device.nbytes, 8, 64)

    def transport(host: np.ndarray, k: int) -> None:
        host.view(np.int64)[:] = np.arange(k * 8, k * 8 + host.nbytes // 8)

    run_segmented(copier, _host_buffers(64), segments, transport, download=False, upload=True)
    np.testing.assert_array_equal(device, np.arange(100))
    assert {what for what, _ in copier.log} == {"upload"}

    sender = ThreadCopier(device)
    run_segmented(sender, _host_buffers(64), segments, lambda host, k: None,
                  download=True, upload=False)
    assert {what for what, _ in sender.log} == {"download"}


def test_a_failing_transport_still_waits_for_the_copies():
    device = np.zeros(64, dtype=np.uint8)
    copier = ThreadCopier(device)

    def transport(host: np.ndarray, k: int) -> None:
        if k == 2:
            raise RuntimeError("peer died")

    with pytest.raises(RuntimeError, match="peer died"):
        run_segmented(copier, _host_buffers(16), segment_bounds(64, 1, 16), transport,
                      download=True, upload=True)
    assert copier.finished


def test_staged_elementwise_uses_the_pool_and_gives_every_buffer_back(monkeypatch):
    made = []

    def allocate(nbytes: int) -> np.ndarray:
        made.append(nbytes)
        return np.zeros(nbytes, dtype=np.uint8)

    device = staging.Device(lambda array: ThreadCopier(array.host), staging.PinnedPool(allocate))
    monkeypatch.setattr(staging, "CUDA", device)
    monkeypatch.setenv("COLLS_SEGMENT_BYTES", "64")
    array = StandInDeviceArray(np.arange(50, dtype=np.float32))
    for _ in range(3):
        staging.staged_elementwise(array, lambda host: np.multiply(host, 2, out=host))
    np.testing.assert_array_equal(array.host, np.arange(50, dtype=np.float32) * 8)
    assert made == [64] * PIPELINE_DEPTH  # allocated once, then reused
