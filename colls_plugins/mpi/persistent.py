"""A prepared batch on mpi: MPI persistent requests, started together at every start.

:func:`colls.batch_isend_irecv_init` checks a batch once; on mpi each of its ops then becomes
an ``MPI_Send_init`` / ``MPI_Recv_init`` request, and every start is one ``MPI_Startall`` over
them, followed by one test of each request (the backend's ``_track``: a request already done
shares a completed Work, one still running is left to its waiter and the progress thread).
No route, no buffer and no tag is looked at again: a halo exchange pays MPI's calls and
little more.

The requests are listed sends first when every receive is small (as the backend's own batch
posts them) and tested receives first, so that a send past MPI's eager size can see its
peer's receipt; sends keep their order among themselves, and receives theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from colls.backend import PreparedBatch
from colls.work import Work


class PersistentBatch(PreparedBatch):
    """The persistent requests of one checked batch of NumPy arrays (see the module docstring).

    Args:
        ops: the checked ``(kind, array, peer, tag)`` entries.
        sends_first: list the sends before the receives (the backend's choice by size).
        make_request: ``make_request(kind, array, peer, tag)``, the backend's inactive
            persistent request for one op (raises its errors).
        start_all: ``start_all(requests)`` starts them (raises the backend's errors).
        track: ``track(request, array, kind, peer, tag)``, the Work of a started request.
        free_requests: ``free_requests(requests)`` frees them.
    """

    def __init__(self, ops: Sequence[tuple[str, Any, int | None, int]], sends_first: bool, *,
                 make_request: Callable[[str, Any, int | None, int], Any],
                 start_all: Callable[[list[Any]], None],
                 track: Callable[[Any, Any, str, int | None, int], Work],
                 free_requests: Callable[[list[Any]], None]) -> None:
        self._start_all, self._track, self._free_requests = start_all, track, free_requests
        order: Sequence[int] = range(len(ops))
        if sends_first:
            order = sorted(order, key=lambda i: ops[i][0] != "isend")
        self._requests: list[Any] = []
        self._sent: list[tuple[int, Any]] = []  # (place in the batch, request) of each send
        self._received: list[tuple[int, Any]] = []
        try:
            for i in order:
                kind, array, peer, tag = ops[i]
                request = make_request(kind, array, peer, tag)
                self._requests.append(request)
                (self._sent if kind == "isend" else self._received).append((i, request))
        except BaseException:
            self.free()
            raise
        self._ops = list(ops)  # the arrays: MPI reads and writes them at every start

    def start(self) -> list[Work]:
        """Start every request with one ``MPI_Startall``; return the ops' Works in order."""
        self._start_all(self._requests)
        ops, track = self._ops, self._track
        works: list[Any] = [None] * len(ops)
        for i, request in self._received:
            _kind, array, peer, tag = ops[i]
            works[i] = track(request, array, "irecv", peer, tag)
        for i, request in self._sent:
            _kind, array, peer, tag = ops[i]
            works[i] = track(request, array, "isend", peer, tag)
        return works

    def free(self) -> None:
        """Free the requests (``MPI_Request_free``). Idempotent."""
        requests, self._requests = self._requests, []
        self._free_requests(requests)
