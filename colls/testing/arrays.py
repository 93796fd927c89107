"""Array helpers for tests: a pure-ctypes DLPack producer, a loop over array libraries, and
random arrays whose reductions are exact in every dtype.

:class:`CtypesDLPackArray` exports a NumPy array's memory under any DLPack dtype code, so the
buffer layer (bfloat16 included) is tested with no framework installed, as mpi4py does.
:func:`array_libraries` yields the libraries present (numpy and ctypes always; torch and jax when
installed) so one test body runs on all of them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, final

import numpy as np

from colls import _dlpack_ctypes as dlc
from colls import dtypes
from colls.dtypes import DType

__all__ = [
    "ArrayLibrary",
    "CtypesDLPackArray",
    "array_libraries",
    "live_exports",
    "random_array",
]

# Values whose sums and products over a handful of ranks are exact even in float16/bfloat16:
# signed powers of two (products stay powers of two) and zero; sums are multiples of 0.5 far
# below 2**8, within bfloat16's 8-bit significand.
_EXACT_FLOATS: Final = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0])
_SMALL_INT_LOW: Final = -3
_SMALL_INT_HIGH: Final = 4  # exclusive


@dataclass(eq=False)
class _Export:
    """One export: the managed struct and everything its pointers point into."""

    managed: Any
    keep: list[Any]
    capsule: Any = None
    name: bytes = b""


# Exports not yet released, keyed by the managed struct's address. The producer's deleter (called
# by a consumer) removes an entry; a capsule dropped without being consumed is reclaimed by
# _reclaim_unconsumed. Single dict operations are atomic under the GIL.
_LIVE: dict[int, _Export] = {}


@dlc.DELETER  # type: ignore[untyped-decorator]
def _deleter(managed_ptr: int) -> None:
    _LIVE.pop(managed_ptr, None)


# Private prototypes: setting argtypes on ctypes.pythonapi's shared attributes would leak into
# every other user of ctypes in the process.
_capsule_new = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi)
)


def _references(export: _Export) -> int:
    capsule = export.capsule
    return sys.getrefcount(capsule)


# What _references reports for a capsule that only the registry holds (calibrated, not assumed:
# the count differs between Python versions).
_ONLY_REGISTRY: Final = _references(_Export(None, [], object()))


def _reclaim_unconsumed() -> None:
    """Release exports whose capsule nobody but the registry holds and nobody consumed.

    The capsules have no destructor on purpose: a destructor written in Python (a ctypes
    callback) cannot run while an exception is in flight, which is exactly when a consumer that
    refuses a dtype (NumPy and bfloat16) drops the capsule.
    """
    for address, export in list(_LIVE.items()):
        if _references(export) <= _ONLY_REGISTRY and _capsule_is_valid(export.capsule, export.name):
            _LIVE.pop(address, None)


def _fill_tensor(
    tensor: dlc.DLTensor, array: np.ndarray, code: int, device_type: int, keep: list[Any]
) -> None:
    ndim = array.ndim
    shape = (ctypes.c_int64 * max(ndim, 1))(*array.shape)
    strides = (ctypes.c_int64 * max(ndim, 1))(*(s // array.itemsize for s in array.strides))
    keep += [shape, strides]
    tensor.data = array.ctypes.data if array.size else None
    tensor.device = dlc.DLDevice(device_type, 0)
    tensor.ndim = ndim
    tensor.dtype = dlc.DLDataType(code, array.itemsize * 8, 1)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(strides, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0


@final
class CtypesDLPackArray:
    """A minimal DLPack producer over a NumPy array's memory (zero copy), in pure ctypes.

    Args:
        array: The memory to export; any strides (multiples of the itemsize), any shape.
        dtype_code: DLPack type code to announce (default: the array's own; pass
            ``dtypes.KDL_BFLOAT`` with a uint16 array to export bfloat16).
        readonly: Mark the export read-only (versioned capsules carry the flag; a legacy request
            is refused, as NumPy does, because a legacy capsule cannot carry it).
        device_type: DLPack device type to announce (the memory is host memory: only CPU and
            kDLCUDAHost are honest; others test how consumers refuse a device).

    A consumer that takes the tensor calls the deleter when done. A capsule dropped without
    being consumed is reclaimed at the next export or :func:`live_exports` call rather than by a
    capsule destructor: a ctypes callback cannot run while an exception is in flight, which is
    when a consumer that refuses the dtype (NumPy and bfloat16) drops the capsule.
    """

    def __init__(
        self,
        array: np.ndarray,
        *,
        dtype_code: int | None = None,
        readonly: bool = False,
        device_type: int = dlc.KDL_CPU,
    ) -> None:
        if any(s % array.itemsize for s in array.strides):
            raise ValueError(f"strides {array.strides} are not multiples of {array.itemsize}")
        self.array = array
        self.readonly = readonly
        self.device_type = device_type
        self.dtype_code = (
            dtypes.from_numpy(array.dtype).dlpack[0] if dtype_code is None else dtype_code
        )

    @property
    def dtype(self) -> DType:
        """The colls dtype announced."""
        return dtypes.from_dlpack(self.dtype_code, self.array.itemsize * 8)

    @property
    def shape(self) -> tuple[int, ...]:
        """The exported shape."""
        return tuple(self.array.shape)

    def __dlpack_device__(self) -> tuple[int, int]:
        """Return ``(device_type, 0)``."""
        return (self.device_type, 0)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Return a new 'dltensor' (or 'dltensor_versioned') capsule over the memory."""
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError(
                f"CtypesDLPackArray lives on {self.__dlpack_device__()}, not device {dl_device}"
            )
        versioned = max_version is not None and max_version[0] >= dlc.DLPACK_MAJOR
        if self.readonly and not versioned:
            raise BufferError("cannot export a read-only array through a legacy DLPack capsule")
        array = self.array.copy() if copy else self.array
        keep: list[Any] = [array]
        if versioned:
            managed: Any = dlc.DLManagedTensorVersioned()
            managed.version = dlc.DLPackVersion(dlc.DLPACK_MAJOR, dlc.DLPACK_MINOR)
            managed.flags = (dlc.FLAG_READ_ONLY if self.readonly else 0) | (
                dlc.FLAG_IS_COPIED if copy else 0
            )
            name = dlc.CAPSULE_NAME_VERSIONED
        else:
            managed = dlc.DLManagedTensor()
            name = dlc.CAPSULE_NAME
        _fill_tensor(managed.dl_tensor, array, self.dtype_code, self.device_type, keep)
        managed.deleter = _deleter
        address = ctypes.addressof(managed)
        _reclaim_unconsumed()
        capsule = _capsule_new(address, name, None)
        _LIVE[address] = _Export(managed, keep, capsule, name)
        return capsule


def live_exports() -> int:
    """Return how many exports are still held by a capsule or a consumer (for leak tests)."""
    _reclaim_unconsumed()
    return len(_LIVE)


class ArrayLibrary(NamedTuple):
    """One array library: ``from_numpy(words, dtype)`` and ``to_numpy(obj)`` (holding dtype)."""

    name: str
    from_numpy: Callable[[np.ndarray, DType], Any]
    to_numpy: Callable[[Any], np.ndarray]

    def supports(self, dtype: DType) -> bool:
        """Whether this library can hold ``dtype`` faithfully (JAX needs x64 for 64-bit)."""
        if self.name == "numpy" and dtype is dtypes.BFLOAT16:
            return importlib.util.find_spec("ml_dtypes") is not None
        if self.name != "jax" or dtype.itemsize < 8 or dtype is dtypes.COMPLEX64:
            return True
        import jax

        return bool(jax.config.read("jax_enable_x64"))  # type: ignore[no-untyped-call]


def _numpy_library() -> ArrayLibrary:
    def make(a: np.ndarray, dtype: DType) -> np.ndarray:
        copy = np.array(a, copy=True)
        if dtype is dtypes.BFLOAT16:
            import ml_dtypes

            return copy.view(ml_dtypes.bfloat16)
        return copy

    def back(a: np.ndarray) -> np.ndarray:
        return a.view(np.uint16) if a.dtype.name == "bfloat16" else np.asarray(a)

    return ArrayLibrary("numpy", make, back)


def _ctypes_library() -> ArrayLibrary:
    def make(a: np.ndarray, dtype: DType) -> CtypesDLPackArray:
        return CtypesDLPackArray(np.array(a, copy=True), dtype_code=dtype.dlpack[0])

    return ArrayLibrary("ctypes", make, lambda obj: obj.array)


def _torch_library() -> ArrayLibrary | None:
    try:
        import torch
    except ImportError:
        return None

    def make(a: np.ndarray, dtype: DType) -> Any:
        if dtype is dtypes.BFLOAT16:
            return torch.from_numpy(np.array(a, copy=True).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.array(a, copy=True))

    def back(t: Any) -> np.ndarray:
        t = t.detach().cpu()
        if t.dtype == torch.bfloat16:
            return np.asarray(t.view(torch.int16).numpy().view(np.uint16))
        return np.asarray(t.numpy())

    return ArrayLibrary("torch", make, back)


def _jax_library() -> ArrayLibrary | None:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    cpu = jax.devices("cpu")[0]

    def make(a: np.ndarray, dtype: DType) -> Any:
        if dtype is dtypes.BFLOAT16:
            a = a.view(jnp.bfloat16)
        return jax.device_put(a, cpu)

    def back(x: Any) -> np.ndarray:
        out = np.asarray(x)
        return out.view(np.uint16) if out.dtype.name == "bfloat16" else out

    return ArrayLibrary("jax", make, back)


def array_libraries() -> Iterator[ArrayLibrary]:
    """Yield the available array libraries: numpy, torch (CPU), jax (CPU), ctypes."""
    yield _numpy_library()
    for factory in (_torch_library, _jax_library):
        library = factory()
        if library is not None:
            yield library
    yield _ctypes_library()


def random_array(
    dtype: DType, shape: tuple[int, ...] | int, rng: np.random.Generator
) -> np.ndarray:
    """Return random values of ``dtype`` (holding type) whose reductions are exact.

    Integers are small (-3..3, or 0..3 unsigned), floats are 0 or signed powers of two in
    [0.5, 2], complex numbers have such real and imaginary parts, bfloat16 is given as words.
    """
    if dtype is dtypes.BOOL:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in ("int", "uint"):
        low = 0 if dtype.kind == "uint" else _SMALL_INT_LOW
        return rng.integers(low, _SMALL_INT_HIGH, size=shape).astype(dtype.numpy)
    values = rng.choice(_EXACT_FLOATS, size=shape)
    if dtype.is_complex:
        values = values + 1j * rng.choice(_EXACT_FLOATS, size=shape)
    if dtype is dtypes.BFLOAT16:
        return dtypes.float32_to_bf16(values.astype(np.float32))
    return values.astype(dtype.numpy)
