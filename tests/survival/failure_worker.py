"""One rank of the failure-mode jobs of tests/survival/test_failure_modes.py.

Started as a plain process with the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: rank 0 hosts the store). Every rank prints one line ``result {json}`` (one write
per line), except the victim, which dies. Scenarios (``sys.argv[1]``):

* ``midcall OP VICTIM DELAY_S``: a few correct rounds of OP, then VICTIM arms a timer that
  SIGKILLs it DELAY_S seconds into the next OP (0: before it starts; it enters the call
  VICTIM_LATE_S after the others) on a large buffer. Each
  survivor reports how that call ended: what it raised (type, message, ``failed_ranks``), or,
  when it returned, whether its output equals the NumPy reference of the whole call exactly
  (inputs are small integers, so any order of summation is exact). Then one more all_reduce,
  which must raise unless every survivor got a whole result. OP is all_reduce, all_gather,
  broadcast (root: the rank after the victim), reduce_scatter, or recv (the victim's successor
  receives from it while the victim sends, the others exchange among themselves).
* ``stalled VICTIM``: VICTIM stops (SIGSTOP) instead of dying; the others' all_reduce times
  out, they shrink without it and check the shrunk group's all_reduce.
* ``store_host_dies``: rank 0 (the store's host) SIGKILLs itself; the survivors' all_reduce
  fails, and each reports what ``colls.shrink_group()`` raised and how long it took.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np

import colls

#: Elements per rank of the call the victim dies in: 8 MiB of float64, many segments.
LARGE = 1 << 20
#: Seconds the victim enters the call after the others (who are blocked in it by then).
VICTIM_LATE_S = 0.3
#: Elements of the warm-up rounds (connections and shared memory up on every rank).
WARM = 1 << 12


def say(kind: str, **fields: Any) -> None:
    sys.stdout.write(f"{kind} {json.dumps(fields)}\n")
    sys.stdout.flush()


def contribution(rank: int, count: int) -> np.ndarray:
    """Rank ``rank``'s input: small integers as float64, distinct per rank and element."""
    return ((np.arange(count, dtype=np.int64) * 7 + rank * 13) % 101).astype(np.float64)


class Case:
    """One OP on ``count`` elements per rank: its buffers, the call, and the reference."""

    def __init__(self, op: str, rank: int, size: int, victim: int, count: int) -> None:
        self.op, self.rank, self.size, self.victim, self.count = op, rank, size, victim, count
        self.root = (victim + 1) % size
        if op == "all_gather":
            self.input = contribution(rank, count)
            self.output = [np.zeros(count) for _ in range(size)]
        elif op == "reduce_scatter":
            self.inputs = [contribution(rank, count)[i::size].copy() for i in range(size)]
            self.output = np.zeros_like(self.inputs[rank])
        elif op == "recv":
            self.output = np.zeros(count)
        else:
            self.output = contribution(rank, count)

    def call(self) -> None:
        op = self.op
        if op == "all_reduce":
            colls.all_reduce(self.output)
        elif op == "all_gather":
            colls.all_gather(self.output, self.input)
        elif op == "broadcast":
            colls.broadcast(self.output, src=self.root)
        elif op == "reduce_scatter":
            colls.reduce_scatter(self.output, self.inputs)
        elif op == "recv":
            self._p2p()
        else:
            raise ValueError(f"unknown op {op!r}")

    def _p2p(self) -> None:
        """The victim sends to its successor; the other two survivors swap with each other."""
        victim, successor = self.victim, self.root
        if self.rank == victim:
            colls.send(contribution(victim, self.count), dst=successor)
        elif self.rank == successor:
            colls.recv(self.output, src=victim)
        else:
            partner = next(r for r in range(self.size) if r not in (victim, successor, self.rank))
            colls.send(contribution(self.rank, self.count), dst=partner)
            colls.recv(self.output, src=partner)

    def expected(self) -> Any:
        """The NumPy reference of this rank's output of the whole call."""
        size, count = self.size, self.count
        if self.op == "all_reduce":
            return sum(contribution(r, count) for r in range(size))
        if self.op == "all_gather":
            return [contribution(r, count) for r in range(size)]
        if self.op == "broadcast":
            return contribution(self.root, count)
        if self.op == "reduce_scatter":
            return sum(contribution(r, count) for r in range(size))[self.rank::size]
        if self.rank == self.victim:  # it only sends
            return np.zeros(count)
        sender = self.victim if self.rank == self.root else next(
            r for r in range(size) if r not in (self.victim, self.root, self.rank))
        return contribution(sender, count)

    def whole(self) -> bool:
        """Whether the output equals the reference exactly."""
        want = self.expected()
        if isinstance(want, list):
            return all(np.array_equal(a, b) for a, b in zip(self.output, want, strict=True))
        return bool(np.array_equal(self.output, want))


def outcome(call: Any) -> dict[str, Any]:
    """Run ``call``; return how it ended (``type`` None: it returned)."""
    start = time.monotonic()
    try:
        call()
    except colls.CollsError as exc:
        return {"type": type(exc).__name__, "message": str(exc),
                "failed_ranks": list(getattr(exc, "failed_ranks", ())),
                "elapsed": time.monotonic() - start}
    return {"type": None, "elapsed": time.monotonic() - start}


def midcall(op: str, victim: int, delay: float) -> None:
    rank, size = colls.get_rank(), colls.get_world_size()
    for _ in range(2):  # warm-up rounds, checked like the real one
        warm = Case(op, rank, size, victim, WARM)
        warm.call()
        if not warm.whole():
            raise AssertionError(f"rank {rank}: warm-up {op} returned wrong values")
    case = Case(op, rank, size, victim, LARGE)
    expected = case.expected()  # computed before the call, so the kill lands inside it
    colls.barrier()
    if rank == victim:
        # The barrier's last messages from this rank may still be on their way: dying at once
        # could fail the others' barrier instead of the call under test.
        time.sleep(VICTIM_LATE_S)
        if delay <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    report = outcome(case.call)
    if report["type"] is None:
        want = expected
        got = case.output
        report["whole"] = (all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
                           if isinstance(want, list) else bool(np.array_equal(got, want)))
    if rank == victim:  # the timer fired too late: the victim must not report
        time.sleep(60)
    report["next"] = outcome(lambda: colls.all_reduce(np.ones(4)))
    say("result", rank=rank, **report)


def store_host_dies() -> None:
    rank = colls.get_rank()
    colls.all_reduce(np.ones(4))
    colls.barrier()
    if rank == 0:
        time.sleep(0.3)  # the others are inside the all_reduce
        os.kill(os.getpid(), signal.SIGKILL)
    first = outcome(lambda: colls.all_reduce(np.ones(LARGE)))
    shrink = outcome(colls.shrink_group)
    say("result", rank=rank, first=first, shrink=shrink)


def stalled(victim: int) -> None:
    """``victim`` stops (SIGSTOP: alive, its connections open, silent); the others' all_reduce
    times out, they shrink (deciding at the round's deadline: nobody is seen dead) and check
    the shrunk group's all_reduce against NumPy."""
    rank, size = colls.get_rank(), colls.get_world_size()
    colls.all_reduce(np.ones(4))
    colls.barrier()
    if rank == victim:
        time.sleep(VICTIM_LATE_S)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)  # the test kills it
        return
    first = outcome(lambda: colls.all_reduce(np.ones(WARM)))
    began = time.monotonic()
    group = colls.shrink_group()
    shrunk = {"rank": group.rank, "size": group.size, "world_ranks": list(group.global_ranks),
              "elapsed": time.monotonic() - began}
    survivors = [r for r in range(size) if r != victim]
    data = contribution(rank, LARGE)
    colls.all_reduce(data)
    whole = bool(np.array_equal(data, sum(contribution(r, LARGE) for r in survivors)))
    say("result", rank=rank, first=first, shrunk=shrunk, whole=whole)


def main() -> None:
    colls.init_process_group("tcp", timeout=float(os.environ.get("FAILURE_GROUP_TIMEOUT", "30")))
    scenario = sys.argv[1]
    if scenario == "midcall":
        midcall(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif scenario == "store_host_dies":
        store_host_dies()
    elif scenario == "stalled":
        stalled(int(sys.argv[2]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
