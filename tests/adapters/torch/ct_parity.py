"""Scenarios of test_torch_parity.py: torch.distributed and colls_torch side by side.

Pool scenarios (``fn(rank, size)``) run in workers that are in a gloo world and a colls_torch
world at once; the ``fresh_*`` functions run on new processes and initialise what they need.
Each returns plain data (names, lists, booleans) for the test to assert on.
"""

from __future__ import annotations

import datetime
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import colls_torch as C
import torch
import torch.distributed as T

from colls.testing.spawn import free_port

#: Floating dtypes gloo reduces, and the complex one PREMUL_SUM also covers.
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _inputs(dtype: torch.dtype, rank: int, n: int = 6) -> torch.Tensor:
    """Small integers, exact in every dtype and in every sum of them."""
    base = (torch.arange(n) * 3 + rank * 5) % 7 - 3
    if dtype.is_complex:
        return torch.complex(base.float(), (base.float() * 2) % 5 - 2).to(dtype)
    return base.to(dtype)


# -- PREMUL_SUM: colls_torch._make_nccl_premul_sum --------------------------------------------


def premul_sum_everywhere(rank: int, size: int) -> list[str]:
    """all_reduce / reduce / reduce_scatter / reduce_scatter_tensor with C._make_nccl_premul_sum.

    The expected result is gloo's SUM of inputs torch multiplied by the factor (torch's
    PREMUL_SUM semantics: sum over ranks of factor * x; gloo has no PREMUL_SUM itself). A factor
    may differ per rank, as NCCL's does.
    """
    failures: list[str] = []

    def same(label: str, expected: torch.Tensor, got: torch.Tensor) -> None:
        if not (expected.dtype == got.dtype and torch.equal(expected, got)):
            failures.append(f"rank {rank} {label}: torch {expected!r}, colls {got!r}")

    factors: list[Any] = [0.5, 3.0, torch.tensor([0.25]), float(rank + 1)]
    for dtype in [*FLOATS, torch.complex64]:
        for factor in factors:
            scale = factor.item() if torch.is_tensor(factor) else factor
            op = C._make_nccl_premul_sum(factor)
            label = f"{dtype} factor {scale}"

            expected, got = _inputs(dtype, rank) * scale, _inputs(dtype, rank)
            T.all_reduce(expected)
            C.all_reduce(got, op=op)
            same(f"all_reduce {label}", expected, got)

            work = C.all_reduce(got := _inputs(dtype, rank), op=op, async_op=True)
            work.wait()
            same(f"all_reduce async {label}", expected, got)

            for dst in range(size):
                expected, got = _inputs(dtype, rank) * scale, _inputs(dtype, rank)
                T.reduce(expected, dst)
                C.reduce(got, dst, op=op)
                if rank == dst:
                    same(f"reduce to {dst} {label}", expected, got)

            chunks = [_inputs(dtype, rank + j, 4) for j in range(size)]
            expected, got = torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype)
            T.reduce_scatter(expected, [c * scale for c in chunks])
            C.reduce_scatter(got, [c.clone() for c in chunks], op=op)
            same(f"reduce_scatter {label}", expected, got)

            flat = torch.cat(chunks)
            expected, got = torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype)
            T.reduce_scatter_tensor(expected, flat * scale)
            C.reduce_scatter_tensor(got, flat.clone(), op=op)
            same(f"reduce_scatter_tensor {label}", expected, got)
    return failures


# -- IEEE results without warnings --------------------------------------------------------------


def _finfo_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def _same_ieee(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, NaN at the same places, every other element equal (inf with its sign)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))



def _reduce_silently(values: list[float], dtype: torch.dtype, name: str, op: Any,
                     expected: torch.Tensor, rank: int, failures: list[str],
                     caught: list[str]) -> None:
    """all_reduce ``values`` through colls_torch; note a result unlike ``expected`` or a warning."""
    got = torch.tensor(values, dtype=dtype)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        C.all_reduce(got, op=op)
    caught += [f"{dtype} {name}: {w.message}" for w in seen]
    if not _same_ieee(expected, got):
        failures.append(f"rank {rank} {dtype} {name}: torch {expected}, colls {got}")

def ieee_reductions(rank: int, size: int) -> dict[str, Any]:
    """Reductions that overflow, make NaN or underflow: colls_torch gives gloo's results, silently.

    Inputs are chosen so that every summation order gives the same IEEE result (each rank
    contributes the same overflowing value, or one inf of each sign), so gloo's order and colls'
    may differ. AVG and PREMUL_SUM (which gloo lacks) are compared with torch's arithmetic on
    gloo's SUM. Every RuntimeWarning raised while colls runs is recorded.
    """
    failures: list[str] = []
    caught: list[str] = []
    for dtype in FLOATS:
        big = _finfo_max(dtype)
        tiny = float(torch.finfo(dtype).tiny)
        sign_inf = math.inf if rank == 0 else -math.inf
        cases: list[tuple[str, Any, list[float]]] = [
            ("SUM", T.ReduceOp.SUM, [big, -big, sign_inf, 1.0]),
            ("PRODUCT", T.ReduceOp.PRODUCT, [big, -big, tiny, 0.0 if rank == 0 else math.inf]),
            ("MIN", T.ReduceOp.MIN, [big, -big, sign_inf, 1.0]),
            ("MAX", T.ReduceOp.MAX, [big, -big, sign_inf, 1.0]),
        ]
        for name, op, values in cases:
            expected = torch.tensor(values, dtype=dtype)
            T.all_reduce(expected, op=op)
            _reduce_silently(values, dtype, name, op, expected, rank, failures, caught)
        values = [big, -big, sign_inf, 1.0]
        summed = torch.tensor(values, dtype=dtype)
        T.all_reduce(summed)
        derived = {
            "AVG": (T.ReduceOp.AVG, summed / size),
            "PREMUL_SUM": (C._make_nccl_premul_sum(4.0), _sum_of(values, dtype, 4.0)),
        }
        for name, (op, expected) in derived.items():
            _reduce_silently(values, dtype, name, op, expected, rank, failures, caught)
    return {"failures": failures, "warnings": caught}


def _sum_of(values: list[float], dtype: torch.dtype, factor: float) -> torch.Tensor:
    """gloo's SUM of ``factor * values`` (torch's own multiplication, then gloo's sum)."""
    scaled = torch.tensor(values, dtype=dtype) * factor
    T.all_reduce(scaled)
    return scaled


# -- the exceptions torch programs catch -----------------------------------------------------


def _raised(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # the type is what is compared
        return exc
    return None


class Compare:
    """Runs each mistake through torch.distributed and colls_torch; records what each raised."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def both(self, case: str, torch_call: Callable[[], Any], colls_call: Callable[[], Any]
             ) -> None:
        expected, got = _raised(torch_call), _raised(colls_call)
        self.rows.append({
            "case": case,
            "torch": None if expected is None else type(expected).__name__,
            "colls": None if got is None else type(got).__name__,
            "colls message": "" if got is None else str(got)[:200],
            "instance": expected is not None and isinstance(got, type(expected)),
        })

    def same(self, case: str, call: Callable[[Any], Any]) -> None:
        """The same call through both modules."""
        self.both(case, lambda: call(T), lambda: call(C))


def _without_env(*names: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def wrap(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            saved = {n: os.environ.pop(n) for n in names if n in os.environ}
            try:
                return call()
            finally:
                os.environ.update(saved)
        return run
    return wrap


def fresh_mistakes(rank: int, size: int) -> list[dict[str, Any]]:
    """One process: each mistake through torch.distributed (gloo) and colls_torch."""
    cmp = Compare()
    t = torch.ones(2)

    def init(d: Any, backend: str = "gloo", **kwargs: Any) -> None:
        kwargs.setdefault("store", T.HashStore())
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
        d.init_process_group(backend, **kwargs)

    # before init_process_group
    cmp.same("destroy_process_group before init", lambda d: d.destroy_process_group())
    cmp.same("get_rank before init", lambda d: d.get_rank())
    cmp.same("all_reduce before init", lambda d: d.all_reduce(torch.ones(1)))
    cmp.same("barrier before init", lambda d: d.barrier())
    cmp.same("new_group before init", lambda d: d.new_group([0]))
    # init_process_group's mistakes (none of them initialises anything)
    cmp.same("init: unknown backend", lambda d: init(d, "no-such-backend"))
    cmp.same("init: ucc (not built / not in colls)", lambda d: init(d, "ucc"))
    cmp.same("init: nccl (not built / no colls nccl)", lambda d: init(d, "nccl"))
    cmp.same("init: rank out of range", lambda d: init(d, rank=2, world_size=1))
    cmp.same("init: both init_method and store",
             lambda d: init(d, init_method="env://", store=T.HashStore()))
    cmp.same("init: unknown init_method scheme",
             lambda d: init(d, init_method="bogus://x", store=None))
    cmp.same("init: env:// without RANK", lambda d: _without_env("RANK")(
        lambda: d.init_process_group("gloo", init_method="env://"))())
    cmp.same("init: env:// without MASTER_ADDR", lambda d: _without_env("MASTER_ADDR")(
        lambda: d.init_process_group("gloo", init_method="env://", rank=0, world_size=1))())
    # initialised: the same world in both
    init(T)
    init(C)
    cmp.same("init twice", lambda d: init(d))
    cmp.same("new_group: unknown backend", lambda d: d.new_group([0], backend="no-such-backend"))
    cmp.same("new_group: rank out of range", lambda d: d.new_group([0, 3]))
    for name, call in {
        "get_rank": lambda d: d.get_rank(42),
        "get_backend": lambda d: d.get_backend(42),
        "get_backend_config": lambda d: d.get_backend_config(42),
        "get_global_rank": lambda d: d.get_global_rank(42, 0),
        "get_group_rank": lambda d: d.get_group_rank(42, 0),
        "all_reduce": lambda d: d.all_reduce(t, group=42),
        "barrier": lambda d: d.barrier(group=42),
        "destroy_process_group": lambda d: d.destroy_process_group(42),
    }.items():
        cmp.same(f"{name}: not a group", call)
    cmp.same("get_global_rank: group rank out of range",
             lambda d: d.get_global_rank(d.new_group([0]), 5))
    cmp.same("broadcast: src out of range", lambda d: d.broadcast(t, 5))
    cmp.same("reduce: dst out of range", lambda d: d.reduce(t, 5))
    cmp.same("send: to oneself", lambda d: d.send(t, 0))
    cmp.same("isend: to oneself", lambda d: d.isend(t, 0).wait())
    cmp.same("irecv: from oneself", lambda d: d.irecv(t, 0).wait())
    cmp.same("recv: from oneself", lambda d: d.recv(t, 0))
    cmp.same("all_reduce: BAND on float", lambda d: d.all_reduce(t, op=d.ReduceOp.BAND))
    cmp.same("all_reduce: AVG on int", lambda d: d.all_reduce(torch.ones(2, dtype=torch.int64),
                                                              op=d.ReduceOp.AVG))
    short = datetime.timedelta(milliseconds=100)
    cmp.same("store: get times out", lambda d: (
        s := d.HashStore(), s.set_timeout(short), s.get("missing")))
    cmp.same("TCPStore: no server", lambda d: d.TCPStore(
        "127.0.0.1", free_port(), timeout=datetime.timedelta(milliseconds=300)))
    C.destroy_process_group()
    T.destroy_process_group()
    return cmp.rows


def fresh_timeouts(rank: int, size: int, ports: tuple[int, int], done_path: str
                   ) -> list[dict[str, Any]]:
    """Two processes: rank 1 never joins rank 0's calls, which must end at their timeouts.

    Each library has its own world (on ``ports``) and groups: one with a 1 s timeout, the rest
    60 s. Rank 1 creates them (group creation is collective), then waits until rank 0 has
    written ``done_path``.
    """
    cmp = Compare()
    one_s, long = datetime.timedelta(seconds=1), datetime.timedelta(seconds=60)
    groups: dict[Any, dict[str, Any]] = {}
    for d, port in zip((T, C), ports, strict=True):
        d.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=size, timeout=long)
        groups[d] = {
            "short": d.new_group(timeout=one_s),
            "barrier": d.new_group(timeout=long),
            "wait": d.new_group(timeout=long),
            "monitored": d.new_group(timeout=long),
        }
    if rank != 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(done_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        return []

    def timed(call: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(d: Any) -> Any:
            start = time.monotonic()
            try:
                return call(d)
            finally:
                elapsed[d] = time.monotonic() - start
        return run

    elapsed: dict[Any, float] = {}
    cases = {
        "all_reduce past the group's 1 s timeout":
            lambda d: d.all_reduce(torch.ones(1), group=groups[d]["short"]),
        "barrier(timeout=1 s) on a 60 s group":
            lambda d: d.barrier(group=groups[d]["barrier"], timeout=one_s),
        "Work.wait(timeout=1 s)":
            lambda d: d.all_reduce(torch.ones(1), group=groups[d]["wait"],
                                   async_op=True).wait(one_s),
        "monitored_barrier(timeout=1 s)":
            lambda d: d.monitored_barrier(group=groups[d]["monitored"], timeout=one_s),
    }
    for case, call in cases.items():
        cmp.same(case, timed(call))
        cmp.rows[-1]["elapsed"] = {"torch": elapsed[T], "colls": elapsed[C]}
    with open(done_path, "w") as f:
        f.write("done")
    return cmp.rows


# -- breakpoint ---------------------------------------------------------------------------------

#: Seconds the breaking rank stays "in pdb".
HOLD_S = 1.5


class _PdbRecorder:
    """Stands in for torch's interactive pdb (a worker has no terminal): records, then holds."""

    stops: list[str] = []

    def message(self, text: str) -> None:
        self.stops.append(text)

    def set_trace(self) -> None:
        self.stops.append("set_trace")
        time.sleep(HOLD_S)


def breakpoint_waits(rank: int, size: int) -> dict[str, Any]:
    """Rank size-1 stops (on the second call: skip=1); the others wait for it in a barrier."""
    _PdbRecorder.stops = []
    original = T._make_distributed_pdb
    T._make_distributed_pdb = _PdbRecorder
    try:
        start = time.monotonic()
        for _ in range(2):
            C.breakpoint(rank=size - 1, skip=1)  # one call site: the first call is skipped
        elapsed = time.monotonic() - start
    finally:
        T._make_distributed_pdb = original
    return {"stops": list(_PdbRecorder.stops), "elapsed": elapsed}


def group_methods(rank: int, size: int) -> dict[str, list[tuple[int, int]]]:
    """Read ``rank()`` and ``size()`` off the world group and a subgroup, through both faces.

    torch's groups are ProcessGroup objects with methods; colls_torch's are colls groups and
    ``group.WORLD`` a sentinel standing for the default group. Both must answer alike.
    """
    found = {}
    for name, dist in (("torch", T), ("colls_torch", C)):
        upper = dist.new_group(list(range(1, size)))
        seen = [(dist.group.WORLD.rank(), dist.group.WORLD.size())]
        if rank >= 1:
            seen.append((upper.rank(), upper.size()))
        found[name] = seen
    return found
