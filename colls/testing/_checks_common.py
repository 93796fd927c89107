"""What every conformance check shares: the per-rank context, array libraries and assertions.

A check is a module-level function ``check_x(s: Suite) -> None`` run on every rank of a world in
the same order. Inputs are derived from ``(seed, case key, rank)``, so every rank can rebuild every
other rank's input and compute the NumPy reference locally; no reference data travels. A failing
case raises :class:`CheckFailure`, whose message names the check, the backend, the world size, the
rank and the case's fields (dtype, op, root, count).
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from colls import dtypes
from colls.dtypes import DType
from colls.reduce_ops import PremulSum, RedOpType, resolve_op
from colls.testing import arrays

#: Marker at the start of every CheckFailure message; check_backend looks for it in tracebacks.
FAILURE_MARKER: Final = "conformance check"

#: Dtypes of the full matrix, and of quick mode (one of each kind, bfloat16 included).
ALL_DTYPES: Final = dtypes.DTYPES
QUICK_DTYPES: Final = (
    dtypes.BOOL, dtypes.INT64, dtypes.UINT8, dtypes.BFLOAT16, dtypes.FLOAT32, dtypes.COMPLEX128,
)  # fmt: skip

#: An element count larger than one pipeline segment: check_backend sets COLLS_SEGMENT_BYTES to
#: SEGMENT_BYTES, so LARGE_COUNT float32 elements span three segments.
SEGMENT_BYTES: Final = 4096
LARGE_COUNT: Final = 3000
ODD_COUNT: Final = 37
ALL_COUNTS: Final = (0, 1, ODD_COUNT, LARGE_COUNT)
QUICK_COUNTS: Final = (0, ODD_COUNT, LARGE_COUNT)


class CheckFailure(AssertionError):
    """A conformance case failed on this rank; the message says which and why."""


# -- array libraries -------------------------------------------------------------------------------


class ArrayLib:
    """How the suite makes user arrays of one library and reads them back as NumPy words.

    Args:
        name: "numpy" or "torch".
    """

    def __init__(self, name: str) -> None:
        if name == "numpy":
            self._lib = arrays._numpy_library()
            self._bf16 = self._lib if self._lib.supports(dtypes.BFLOAT16) else None
        elif name == "torch":
            library = arrays._torch_library()
            if library is None:
                raise ValueError("array_library='torch' needs torch, which is not installed")
            self._lib = self._bf16 = library
        else:
            raise ValueError(f"array_library must be 'numpy' or 'torch', got {name!r}")
        self.name = name

    def make(self, words: np.ndarray, dtype: DType) -> Any:
        """Return a new writable array of this library holding a copy of ``words``."""
        if dtype is dtypes.BFLOAT16 and self._bf16 is None:  # NumPy without ml_dtypes
            copy = np.array(words, copy=True)
            return arrays.CtypesDLPackArray(copy, dtype_code=dtypes.KDL_BFLOAT)
        return self._lib.from_numpy(np.asarray(words, dtype=dtype.numpy), dtype)

    def strided(self, words: np.ndarray, dtype: DType) -> tuple[Any, Any]:
        """Return ``(view, base)``: a stride-2 view holding ``words`` and the array it views."""
        base_words = np.zeros(2 * words.size, dtype=dtype.numpy)
        base_words[::2] = words.reshape(-1)
        if dtype is dtypes.BFLOAT16 and self._bf16 is None:
            return arrays.CtypesDLPackArray(base_words[::2], dtype_code=dtypes.KDL_BFLOAT), None
        base = self.make(base_words, dtype)
        return base[::2], base

    def to_numpy(self, obj: Any) -> np.ndarray:
        """Return a NumPy copy of ``obj`` in the holding dtype (bfloat16 as uint16 words)."""
        if isinstance(obj, arrays.CtypesDLPackArray):
            return np.array(obj.array, copy=True)
        return np.array(self._lib.to_numpy(obj), copy=True)

    def address(self, obj: Any) -> int:
        """Return the address of ``obj``'s first element."""
        if self.name == "torch":
            return int(obj.data_ptr())
        if isinstance(obj, arrays.CtypesDLPackArray):
            return int(obj.array.ctypes.data)
        return int(obj.ctypes.data)

    def alias(self, obj: Any) -> Any:
        """Return a second view of ``obj``'s memory (taken before a collective runs)."""
        if isinstance(obj, arrays.CtypesDLPackArray):
            return obj.array
        return obj.view(-1) if self.name == "torch" else obj.view()

    def array_type(self) -> type:
        """The type functional collectives must return for this library's arrays."""
        if self.name == "torch":
            import torch

            return torch.Tensor
        return np.ndarray


# -- the per-rank context ------------------------------------------------------------------------


def _key_int(part: Any) -> int:
    if isinstance(part, (int, np.integer)) and not isinstance(part, bool):
        return int(part) & 0xFFFFFFFF
    return zlib.crc32(str(part).encode())


@dataclass
class Suite:
    """One rank's view of a conformance run.

    Attributes:
        rank, world_size: this process in the world group.
        backend: the backend under test.
        lib: the array library the checks use.
        quick: run the reduced matrix.
        seed: base of every input's random generator.
        cases: number of cases run so far (reported back to check_backend).
    """

    rank: int
    world_size: int
    backend: str
    lib: ArrayLib
    quick: bool = False
    seed: int = 0
    cases: int = 0

    @property
    def dtypes(self) -> tuple[DType, ...]:
        """The dtypes of the reduction matrix."""
        return QUICK_DTYPES if self.quick else ALL_DTYPES

    @property
    def counts(self) -> tuple[int, ...]:
        """The element counts every collective is run with."""
        return QUICK_COUNTS if self.quick else ALL_COUNTS

    @property
    def peers(self) -> bool:
        """Whether point-to-point checks can run (a world of one has nobody to talk to)."""
        return self.world_size > 1

    def rng(self, *key: Any) -> np.random.Generator:
        """Return a generator determined by the seed and ``key`` (same on every rank)."""
        return np.random.default_rng([self.seed, *(_key_int(k) for k in key)])

    def inputs(self, dtype: DType, count: int | tuple[int, ...], *key: Any) -> list[np.ndarray]:
        """Return every rank's input for case ``key``: exact-safe values, holding dtype."""
        return [
            arrays.random_array(dtype, count, self.rng(*key, r)) for r in range(self.world_size)
        ]

    def describe(self, check: str, fields: dict[str, Any]) -> str:
        """Return the header of a failure message for ``check`` with ``fields``."""
        parts = [f"backend={self.backend!r}", f"world_size={self.world_size}",
                 f"rank={self.rank}", f"array_library={self.lib.name}"]
        parts += [f"{k}={_show(v)}" for k, v in fields.items() if v is not None]
        return f"{FAILURE_MARKER} {check!r} failed ({', '.join(parts)})"

    @contextlib.contextmanager
    def case(self, check: str, **fields: Any) -> Iterator[None]:
        """Run one case; turn any failure into a CheckFailure naming the check and ``fields``."""
        self.cases += 1
        try:
            yield
        except CheckFailure:
            raise
        except Exception as exc:
            raise CheckFailure(f"{self.describe(check, fields)}: {type(exc).__name__}: {exc}"
                               ) from exc


def _show(value: Any) -> str:
    if isinstance(value, DType):
        return value.name
    if isinstance(value, (RedOpType, PremulSum)):
        return op_label(value)
    return str(value)


# -- reduce ops ----------------------------------------------------------------------------------


def op_label(op: Any) -> str:
    """Return a short name of a reduce op ("SUM", "PREMUL_SUM(2.0)")."""
    if isinstance(op, PremulSum):
        return f"PREMUL_SUM({op.factor!r})"
    return op.name


def op_allowed(op: Any, dtype: DType) -> bool:
    """Return whether torch allows ``op`` on ``dtype`` (the table the suite holds colls to)."""
    kind = op.kind if isinstance(op, PremulSum) else op
    if kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR):
        return dtype.kind in ("bool", "int", "uint")
    if kind in (RedOpType.MIN, RedOpType.MAX):
        return not dtype.is_complex
    if kind in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        return dtype.is_floating or dtype.is_complex
    return True


def reference(op: Any, dtype: DType, inputs: list[np.ndarray]) -> np.ndarray:
    """Return the NumPy reference reduction of every rank's input."""
    return resolve_op(op, dtype, op_name="reference").numpy_reference(inputs)


# -- assertions ----------------------------------------------------------------------------------


def expect(condition: bool, message: str) -> None:
    """Fail with ``message`` unless ``condition``."""
    if not condition:
        raise AssertionError(message)


def expect_equal(got: Any, expected: Any, what: str) -> None:
    """Fail unless ``got`` equals ``expected`` exactly (same shape, same values; NaN == NaN)."""
    got = np.asarray(got)
    expected = np.asarray(expected)
    if got.shape != expected.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {expected.shape}")
    if got.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {got.dtype}, expected {expected.dtype}")
    same = got == expected
    if got.dtype.kind in "fc":
        same |= np.isnan(got) & np.isnan(expected)
    if not np.all(same):
        bad = np.argwhere(~np.asarray(same))
        first = tuple(int(i) for i in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {got.size} elements differ; first at index {first}: "
            f"got {got[first]!r}, expected {expected[first]!r}"
        )


def expect_raises(
    kind: type[BaseException], call: Callable[[], Any], *, contains: tuple[str, ...] = ()
) -> BaseException:
    """Fail unless ``call()`` raises ``kind`` with every string of ``contains`` in its message."""
    try:
        call()
    except kind as exc:
        message = str(exc)
        missing = [text for text in contains if text not in message]
        if missing:
            raise AssertionError(
                f"{kind.__name__} raised as expected, but its message lacks {missing}: {message!r}"
            ) from exc
        return exc
    except Exception as exc:
        raise AssertionError(
            f"expected {kind.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    raise AssertionError(f"expected {kind.__name__}, but the call returned normally")


def sentinel(s: Suite, group: Any = None) -> None:
    """Run one all_reduce and check it: the group still works after what came before."""
    import colls

    members = colls.get_process_group_ranks(group) if group is not None else range(s.world_size)
    probe = np.array([s.rank + 1, 1], dtype=np.int64)
    colls.all_reduce(probe, group=group)
    expected = np.array([sum(r + 1 for r in members), len(members)], dtype=np.int64)
    expect_equal(probe, expected, "follow-up all_reduce (the group must still work)")


def bounded(call: Callable[[], Any], bound: float, what: str) -> tuple[Any, float]:
    """Run ``call`` on a watchdog thread; return ``(value or exception, seconds it took)``.

    Raises:
        AssertionError: ``call`` was still running after ``bound`` seconds (the thread is left
            behind, a daemon: the backend under test is hung, which is the finding).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the checking thread
            box["value"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, name=f"colls-conformance-watchdog: {what}", daemon=True)
    thread.start()
    thread.join(bound)
    elapsed = time.monotonic() - start
    if thread.is_alive():
        raise AssertionError(f"{what} was still blocked after {bound:.0f} s")
    return box["value"], elapsed
