"""DLPack structs in ctypes, and a zero-copy consumer for what NumPy refuses to import.

``np.from_dlpack`` rejects bfloat16 (and any dtype NumPy lacks), yet bfloat16 is the most common
dtype in training. This module reads the ``DLManagedTensor`` (or ``DLManagedTensorVersioned``) out
of a producer's capsule directly, and exposes the memory through ``__array_interface__`` so NumPy
builds a view of it with no copy. The owner object follows the DLPack Python specification:

* the capsule is renamed to ``used_dltensor`` (``used_dltensor_versioned``) once consumed, so the
  producer's capsule destructor no longer frees the tensor;
* the consumer then owns the tensor: a ``weakref.finalize`` on the owner calls the producer's
  ``deleter`` exactly once, when the last view of the memory is gone (NumPy keeps the owner alive
  as the array's ``base``).

Legacy (unversioned) capsules cannot say whether the memory is writable, so they are imported
read-only, as NumPy does. The structs are shared with the test producer in ``colls.testing``.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any, Final, final

import numpy as np

from colls import dtypes
from colls.dtypes import DType

__all__ = [
    "DLDataType",
    "DLDevice",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackVersion",
    "DLTensor",
    "ImportedTensor",
    "import_dlpack",
]

# DLDeviceType values (dlpack.h).
KDL_CPU: Final = 1
KDL_CUDA: Final = 2
KDL_CUDA_HOST: Final = 3
KDL_CUDA_MANAGED: Final = 13

# DLManagedTensorVersioned.flags bits.
FLAG_READ_ONLY: Final = 1 << 0
FLAG_IS_COPIED: Final = 1 << 1

# The DLPack ABI version this consumer understands (major must match exactly).
DLPACK_MAJOR: Final = 1
DLPACK_MINOR: Final = 0

CAPSULE_NAME: Final = b"dltensor"
CAPSULE_NAME_VERSIONED: Final = b"dltensor_versioned"


class DLPackVersion(ctypes.Structure):
    """``DLPackVersion``: the ABI version of a versioned managed tensor."""

    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLDevice(ctypes.Structure):
    """``DLDevice``: where the memory lives."""

    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    """``DLDataType``: type code, bits per lane, lanes."""

    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    """``DLTensor``: data pointer, device, shape and strides (in elements; NULL = C order)."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
"""The deleter signature shared by both managed tensor structs: ``void (*)(void *self)``."""


class DLManagedTensor(ctypes.Structure):
    """``DLManagedTensor`` (legacy capsule "dltensor")."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLManagedTensorVersioned(ctypes.Structure):
    """``DLManagedTensorVersioned`` (capsule "dltensor_versioned", DLPack >= 1.0)."""

    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", DELETER),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


def _pyapi(name: str, restype: Any, *argtypes: Any) -> Any:
    """Bind a C API function with a private prototype (pythonapi's attributes are shared)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_capsule_is_valid = _pyapi("PyCapsule_IsValid", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)
_capsule_get_pointer = _pyapi(
    "PyCapsule_GetPointer", ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p
)
_capsule_set_name = _pyapi("PyCapsule_SetName", ctypes.c_int, ctypes.py_object, ctypes.c_char_p)

# PyCapsule_SetName stores the pointer, not a copy: the new names must live forever.
_USED_NAME: Final = ctypes.create_string_buffer(b"used_dltensor")
_USED_NAME_VERSIONED: Final = ctypes.create_string_buffer(b"used_dltensor_versioned")


def _call_deleter(managed_ptr: int, deleter_ptr: int) -> None:
    """Hand a consumed managed tensor back to its producer (runs once, from weakref.finalize)."""
    if deleter_ptr:
        DELETER(deleter_ptr)(managed_ptr)


@final
class ImportedTensor:
    """Owner of one consumed DLPack tensor; NumPy views of it keep it alive as their ``base``.

    Attributes:
        data: Address of element 0 (``data + byte_offset``).
        shape: Shape in elements.
        strides: Strides in bytes.
        dtype: The colls dtype.
        device: ``(device_type, device_id)``.
        readonly: True when the producer marked the memory read-only or could not say.
    """

    def __init__(
        self,
        managed_ptr: int,
        deleter_ptr: int,
        *,
        data: int,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        dtype: DType,
        device: tuple[int, int],
        readonly: bool,
    ) -> None:
        self.data = data
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device = device
        self.readonly = readonly
        self._finalizer = weakref.finalize(self, _call_deleter, managed_ptr, deleter_ptr)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """Describe the memory to NumPy (bfloat16 as ``uint16`` words)."""
        return {
            "shape": self.shape,
            "typestr": self.dtype.numpy.str,
            "data": (self.data, self.readonly),
            "strides": self.strides,
            "version": 3,
        }

    def release(self) -> None:
        """Call the producer's deleter now (only when no view of the memory exists)."""
        self._finalizer()

    def span(self) -> tuple[int, int]:
        """Return the ``(lowest, one past highest)`` byte addresses any element occupies."""
        low = high = self.data
        if any(n == 0 for n in self.shape):
            return low, low
        for extent, stride in zip(self.shape, self.strides, strict=True):
            reach = (extent - 1) * stride
            if reach < 0:
                low += reach
            else:
                high += reach
        return low, high + self.dtype.itemsize

    def to_numpy(self) -> np.ndarray:
        """Return a zero-copy NumPy view whose ``base`` keeps this owner (and the memory) alive."""
        if any(n == 0 for n in self.shape):
            # A zero-size tensor may carry a NULL pointer, which NumPy cannot wrap.
            return np.empty(self.shape, dtype=self.dtype.numpy)
        return np.asarray(self)


def _request_capsule(obj: Any) -> Any:
    """Ask ``obj`` for a capsule, preferring the versioned ABI (it carries the read-only flag)."""
    try:
        return obj.__dlpack__(max_version=(DLPACK_MAJOR, DLPACK_MINOR))
    except TypeError:
        pass  # an older producer without max_version
    try:
        return obj.__dlpack__()
    except TypeError:
        return obj.__dlpack__(stream=None)


def _read(tensor: DLTensor) -> tuple[DType, tuple[int, ...], tuple[int, ...], int]:
    """Read dtype, shape, byte strides and element-0 address from a DLTensor."""
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    if lanes != 1:
        raise TypeError(f"unsupported DLPack dtype with {lanes} lanes (code {code}, {bits} bits)")
    dtype = dtypes.from_dlpack(code, bits)
    ndim = tensor.ndim
    shape = tuple(int(tensor.shape[i]) for i in range(ndim))
    if ndim and tensor.strides:
        strides = tuple(int(tensor.strides[i]) * dtype.itemsize for i in range(ndim))
    else:
        strides = tuple(
            int(np.prod(shape[i + 1 :], dtype=np.int64)) * dtype.itemsize for i in range(ndim)
        )
    return dtype, shape, strides, (tensor.data or 0) + tensor.byte_offset


def import_dlpack(obj: Any) -> ImportedTensor:
    """Consume ``obj.__dlpack__()`` and return the owner of its memory (zero copy).

    Raises:
        BufferError: the capsule is not a DLPack tensor, or its major version is unknown.
        TypeError: the dtype is not one colls supports.
    """
    capsule = _request_capsule(obj)
    try:
        return _consume(obj, capsule)
    except (BufferError, TypeError) as exc:
        error = exc.with_traceback(None)  # the traceback's frames would keep the capsule alive
    # Drop an unconsumed capsule while no exception is in flight: its destructor frees the
    # tensor, and a destructor written in Python (ctypes) cannot run with an exception pending.
    del capsule
    raise error


def _consume(obj: Any, capsule: Any) -> ImportedTensor:
    """Read the managed tensor out of ``capsule`` and take ownership of it."""
    if _capsule_is_valid(capsule, CAPSULE_NAME_VERSIONED):
        ptr = _capsule_get_pointer(capsule, CAPSULE_NAME_VERSIONED)
        versioned = DLManagedTensorVersioned.from_address(ptr)
        if versioned.version.major != DLPACK_MAJOR:
            raise BufferError(
                f"DLPack ABI version {versioned.version.major}.{versioned.version.minor} is not "
                f"supported (this consumer reads {DLPACK_MAJOR}.x)"
            )
        tensor, deleter, used = versioned.dl_tensor, versioned.deleter, _USED_NAME_VERSIONED
        readonly = bool(versioned.flags & FLAG_READ_ONLY)
    elif _capsule_is_valid(capsule, CAPSULE_NAME):
        ptr = _capsule_get_pointer(capsule, CAPSULE_NAME)
        legacy = DLManagedTensor.from_address(ptr)
        tensor, deleter, used = legacy.dl_tensor, legacy.deleter, _USED_NAME
        readonly = True  # a legacy capsule cannot say the memory is writable (NumPy agrees)
    else:
        raise BufferError(
            f"{type(obj).__name__}.__dlpack__() returned {capsule!r}, not an unconsumed "
            "'dltensor' or 'dltensor_versioned' capsule"
        )
    dtype, shape, strides, data = _read(tensor)
    device = (int(tensor.device.device_type), int(tensor.device.device_id))
    deleter_ptr = ctypes.cast(deleter, ctypes.c_void_p).value or 0
    # From here on the tensor is ours: renaming stops the capsule's destructor from freeing it.
    _capsule_set_name(capsule, used)
    return ImportedTensor(
        ptr,
        deleter_ptr,
        data=data,
        shape=shape,
        strides=strides,
        dtype=dtype,
        device=device,
        readonly=readonly,
    )
