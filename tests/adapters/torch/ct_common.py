"""Shared pieces of the differential scenarios: inputs, outcomes, comparison.

A differential check runs one ``body(dist, group)`` twice in the same worker: once with
``dist = torch.distributed`` (gloo) and once with ``dist = colls_torch`` (the "dropin" face) or
with torch.distributed bound to a group of the ``colls`` c10d backend (the "c10d" face), on
freshly built, identical inputs. The *outcome* of each run is compared: the value the body
returns (tensors compared exactly, with dtype and shape), or the exception type if it raised.
So the same code checks results, return values and the exception types of misuse.

Each check also states the outcome it expects: that the body returns (the default), or which
exception type it raises. The reference must give that outcome, so a scenario with a bug of its
own (a body that raises where it should return) fails even when both sides raise alike.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import colls_torch as C
import torch
import torch.distributed as T

MODULES = (T, C)

#: Functions whose ``group`` a :class:`Bound` face fills in.
_GROUPED = frozenset(
    "all_reduce broadcast reduce all_gather all_gather_into_tensor all_gather_single gather "
    "scatter reduce_scatter reduce_scatter_tensor reduce_scatter_single all_to_all "
    "all_to_all_single barrier monitored_barrier send recv isend irecv all_gather_object "
    "gather_object broadcast_object_list scatter_object_list send_object_list recv_object_list "
    "all_reduce_coalesced all_gather_coalesced".split()
)


class Bound:
    """torch.distributed with ``group=`` defaulting to one group of one backend.

    Lets the drop-in scenarios run unchanged through torch.distributed's own functions, on a
    ``ProcessGroupColls`` (``new_group(backend="colls")``) and, as the reference, on a gloo
    group of the same ranks (so both sides see a non-default group).
    """

    def __init__(self, group: Any, backend: str) -> None:
        self._group = group
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        value = getattr(T, name)
        if name == "P2POp":
            return functools.partial(_bound_p2pop, self._group)
        if name in ("new_group", "new_subgroups", "new_subgroups_by_enumeration"):
            return functools.partial(value, backend=self._backend)
        if name not in _GROUPED:
            return value
        signature = inspect.signature(value)

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            if bound.arguments.get("group") is None:
                bound.arguments["group"] = self._group
            return value(*bound.args, **bound.kwargs)

        call.original = value  # type: ignore[attr-defined]
        return call


def _bound_p2pop(group: Any, op: Any, tensor: Any, peer: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("group", group)
    return T.P2POp(getattr(op, "original", op), tensor, peer, **kwargs)


_C10D: dict[str, Any] = {}


def faces(face: str) -> tuple[Any, Any]:
    """Return the (reference, checked) pair: torch vs colls_torch, or gloo vs the colls backend."""
    if face == "dropin":
        return (T, C)
    if face == "c10d":
        if not _C10D:  # made once per worker, by every rank in the same scenario
            _C10D["gloo"] = Bound(T.new_group(backend="gloo"), "gloo")
            _C10D["colls"] = Bound(T.new_group(backend="colls"), "colls")
        return (_C10D["gloo"], _C10D["colls"])
    raise ValueError(f"unknown face {face!r}")

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.int32, torch.int8, torch.uint8]
DTYPES = FLOATS + INTS + [torch.bool, torch.complex64]

R = T.ReduceOp
FLOAT_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
INT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
COMPLEX_OPS = [R.SUM, R.AVG]


def ops_for(dtype: torch.dtype) -> list[Any]:
    """Return the reduce ops gloo supports for ``dtype``."""
    if dtype.is_complex:
        return COMPLEX_OPS
    if dtype.is_floating_point:
        return FLOAT_OPS
    return INT_OPS


def make(dtype: torch.dtype, shape: tuple[int, ...], rank: int, salt: int = 0) -> torch.Tensor:
    """Return a deterministic tensor of small integers (exact in every dtype, sums included)."""
    numel = 1
    for d in shape:
        numel *= d
    base = (torch.arange(numel, dtype=torch.int64) * (salt + 3) + rank * 5 + salt) % 7
    if dtype == torch.bool:
        out = base % 2 == 1
    elif dtype.is_complex:
        out = torch.complex(base.float() - 3, (base.float() * 2) % 5 - 2).to(dtype)
    elif dtype == torch.uint8:
        out = base.to(dtype)
    else:
        out = (base - 3).to(dtype)
    return out.reshape(shape)


def noncontiguous(dtype: torch.dtype, rank: int, salt: int = 0) -> torch.Tensor:
    """Return a transposed (non-contiguous) 3x4 view."""
    t = make(dtype, (4, 3), rank, salt).t()
    assert not t.is_contiguous()
    return t


def outcome(body: Callable[[], Any]) -> tuple[str, Any, str]:
    """Return ("ok", value, "") or ("raised", exception type name, message).

    Outcomes are compared without the message (torch's and colls' wordings differ); it is
    kept for the report.
    """
    try:
        return ("ok", body(), "")
    except Exception as exc:  # the type is what is compared
        return ("raised", type(exc).__name__, str(exc))


def _equal(a: Any, b: Any, close: bool = False) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape):
            return False
        return torch.allclose(a, b, rtol=1e-6, atol=0) if close else torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y, close) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], close) for k in a)
    return bool(a == b)


class Checker:
    """Collects differential comparisons; a scenario returns :meth:`report`."""

    def __init__(self, rank: int, face: str = "dropin") -> None:
        self.rank = rank
        self.modules = faces(face)
        self.count = 0
        self.failures: list[str] = []

    def same(self, label: str, torch_out: Any, colls_out: Any, close: bool = False) -> None:
        """Record one comparison (exact; ``close``: tensors within 1e-6 relative)."""
        self.count += 1
        if not _equal(torch_out, colls_out, close):
            self.failures.append(f"rank {self.rank} {label}:\n  torch: {torch_out!r}\n"
                                 f"  colls: {colls_out!r}")

    def both(self, label: str, body: Callable[[Any, Any], Any], groups: tuple[Any, Any]
             = (None, None), close: bool = False, raises: str | None = None) -> None:
        """Run ``body(dist, group)`` with torch.distributed and colls_torch; compare outcomes.

        Args:
            raises: the exception type name the body must raise, or None if it must return.
                The reference side must do what is stated; then colls_torch must match it.
        """
        ref, checked = (outcome(lambda m=m, g=g: body(m, g))
                        for m, g in zip(self.modules, groups, strict=True))
        expected = "return" if raises is None else f"raise {raises}"
        got = "return" if ref[0] == "ok" else f"raise {ref[1]}"
        if got != expected:
            self.count += 1
            self.failures.append(
                f"rank {self.rank} {label}: the scenario expects it to {expected}, but torch "
                f"did {got} {ref[2]!r} (colls: {checked[0]} {checked[1]!r} {checked[2]!r})")
            return
        self.same(label, ref[:2], checked[:2], close=close)

    def check(self, label: str, condition: bool, detail: str = "") -> None:
        """Record a plain assertion."""
        self.count += 1
        if not condition:
            self.failures.append(f"rank {self.rank} {label}: {detail}")

    def report(self) -> tuple[int, list[str]]:
        """Return (number of checks, failures), after a barrier in both worlds."""
        for module in self.modules:
            module.barrier()
        return self.count, self.failures


def assert_all_passed(results: list[tuple[int, list[str]]], minimum: int = 1) -> int:
    """Fail with every rank's failures; return the number of checks of rank 0."""
    failures = [f for _, fails in results for f in fails]
    assert not failures, f"{len(failures)} differences:\n" + "\n".join(failures[:40])
    assert results[0][0] >= minimum, f"only {results[0][0]} checks ran"
    return results[0][0]
