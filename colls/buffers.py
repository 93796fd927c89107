"""Turn any user array into a flat buffer the core can move, and results back into user arrays.

Every collective starts by calling :func:`as_buffer` on its arguments. The result is a
:class:`Buffer`: a C-contiguous, 1-D NumPy view of the caller's memory (CuPy for CUDA memory), the
colls dtype, the shape, and whether the view is a staging copy that must be written back.

How an object is imported: :func:`classify` looks at it once and names its kind, then one
function per kind imports it (:data:`_IMPORTERS`):

* ``ndarray`` (a ``numpy.ndarray``, subclasses viewed as the base class): used directly, no
  DLPack round trip (the hot path).
* ``dlpack-cpu``: a ``__dlpack__`` producer whose memory is on the host (also pinned CUDA host
  memory), viewed with ``np.from_dlpack``; when NumPy rejects the dtype (bfloat16) the ctypes
  consumer in :mod:`colls._dlpack_ctypes` reads the capsule itself, still zero copy.
* ``dlpack-cuda``: CUDA memory, imported with ``cupy.from_dlpack`` (CuPy is imported only then).
* ``dlpack-other`` and ``dlpack-broken``: another DLPack device, or a producer whose
  ``__dlpack_device__`` fails: refused with a TypeError naming the device or the failure.
* ``buffer``: anything else, through the buffer protocol (bytearray, memoryview, array.array),
  or a TypeError saying the object is neither.

The kind also answers where the memory lives (:func:`device_of`), so the core's device check and
the import ask a producer for its device once.

In-place collectives pass ``writable=True``: a read-only array (a JAX array, a read-only NumPy
view) is refused with a TypeError that points at ``colls.functional``. A non-contiguous array is
staged through a contiguous copy (an uninitialised buffer for a receive, whose old contents are
never read: :data:`WRITE_ONLY_OPS`); :meth:`Buffer.write_back` copies results into the original
view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, final

import numpy as np

from colls import _dlpack_ctypes as dlc
from colls import dtypes
from colls.dtypes import DType

__all__ = [
    "Buffer",
    "as_buffer",
    "as_buffers",
    "classify",
    "device_of",
    "empty_array",
    "empty_like_buffer",
    "new_array_like",
    "staged",
]

_CPU_DEVICES: Final = frozenset({dlc.KDL_CPU, dlc.KDL_CUDA_HOST})
_CUDA_DEVICES: Final = frozenset({dlc.KDL_CUDA, dlc.KDL_CUDA_MANAGED})
_DEVICE_NAMES: Final = {
    1: "kDLCPU", 2: "kDLCUDA", 3: "kDLCUDAHost", 4: "kDLOpenCL", 7: "kDLVulkan", 8: "kDLMetal",
    9: "kDLVPI", 10: "kDLROCM", 11: "kDLROCMHost", 12: "kDLExtDev", 13: "kDLCUDAManaged",
    14: "kDLOneAPI", 15: "kDLWebGPU", 16: "kDLHexagon", 17: "kDLMAIA",
}  # fmt: skip
# Errors np.from_dlpack raises for a dtype or layout it cannot express (bf16 -> RuntimeError).
_NUMPY_DLPACK_ERRORS: Final = (BufferError, TypeError, RuntimeError, ValueError)
_BF16_NAMES: Final = frozenset({"bfloat16", "torch.bfloat16"})
# DLPack stream value meaning "the legacy default CUDA stream" (0 is reserved by the spec).
_CUDA_LEGACY_DEFAULT_STREAM: Final = 1


@final
@dataclass(slots=True, eq=False)
class Buffer:
    """A caller's array, as the core moves it. Built by :func:`as_buffer`; do not construct.

    Attributes:
        obj: The caller's object.
        array: C-contiguous 1-D view of the data (NumPy, or CuPy for CUDA); bfloat16 as uint16.
        dtype: The colls dtype.
        shape: The caller's shape (``()`` for a 0-d array, whose ``array`` has one element).
        device: "cpu" or "cuda".
        staged: True when ``array`` is a copy that :meth:`write_back` must copy back (a
            non-contiguous writable argument; a non-contiguous read-only one is copied, not
            staged).
    """

    obj: Any
    array: np.ndarray
    dtype: DType
    shape: tuple[int, ...]
    device: str
    staged: bool = False
    _view: Any = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(self.array.size)

    @property
    def nbytes(self) -> int:
        """Number of bytes of data."""
        return int(self.array.nbytes)

    def write_back(self) -> None:
        """Copy ``array`` into the caller's memory if it is a staging copy; no-op otherwise."""
        if self.staged:
            _module_of(self._view).copyto(self._view, self.array.reshape(self.shape))


#: Operations whose array argument is only written, never read (a receive): a non-contiguous one
#: is staged through an uninitialised buffer, not a copy of its old contents (a strided halo
#: column is then gathered once, on the sending side, as a user packing by hand does).
WRITE_ONLY_OPS = frozenset({"irecv", "recv"})


def _on_rank(rank: int | None) -> str:
    return "" if rank is None else f" on rank {rank}"


def _type_name(obj: Any) -> str:
    cls = type(obj)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _module_of(array: Any) -> Any:
    """Return the array module (numpy or cupy) an array belongs to."""
    if isinstance(array, np.ndarray):
        return np
    import cupy  # only reached for CUDA buffers, which cupy created

    return cupy


def _read_only_error(obj: Any, arg: str, op: str, rank: int | None) -> TypeError:
    return TypeError(
        f"{op}: argument '{arg}'{_on_rank(rank)} is read-only ({_type_name(obj)}); in-place "
        f"collectives write into their argument. Use colls.functional.{op}, which returns a new "
        "array, instead."
    )


def _dtype_error(obj: Any, exc: TypeError, arg: str, op: str, rank: int | None) -> TypeError:
    return TypeError(f"{op}: argument '{arg}'{_on_rank(rank)} ({_type_name(obj)}): {exc}")


def _wrap(
    obj: Any, view: Any, dtype: DType, device: str, writable: bool, arg: str, op: str,
    rank: int | None,
) -> Buffer:  # fmt: skip
    """Build the Buffer for an imported view (NumPy or CuPy), staging it if not C-contiguous."""
    flags = view.flags
    if writable and not flags.writeable:
        raise _read_only_error(obj, arg, op, rank)
    if view.dtype is not dtype.numpy and view.dtype != dtype.numpy:
        view = view.view(dtype.numpy)  # ml_dtypes bfloat16 -> uint16 words (same itemsize)
    if flags.c_contiguous:
        return Buffer(obj, view if view.ndim == 1 else view.reshape(-1), dtype,
                      tuple(view.shape), device)
    return staged(obj, view, dtype, device, writable, write_only=op in WRITE_ONLY_OPS)


def staged(obj: Any, view: Any, dtype: DType, device: str, writable: bool, *,
           write_only: bool) -> Buffer:
    """Build the Buffer of a non-C-contiguous ``view``: a contiguous copy of it, or, when the
    call only writes it (``write_only``, a receive), an uninitialised buffer of its size.

    Only a ``writable`` argument is written back (:meth:`Buffer.write_back`); a read-only one
    is just copied. The general path (:func:`_wrap`) and the fast path's point-to-point calls
    (:func:`colls._fast_path.peer`) both stage here.
    """
    module = _module_of(view)
    if writable and write_only:  # its contents are never read: no copy in
        staging = module.empty(view.shape, view.dtype).reshape(-1)
    else:
        staging = module.ascontiguousarray(view).reshape(-1)
    return Buffer(obj, staging, dtype, tuple(view.shape), device, writable,
                  view if writable else None)


def _from_ndarray(
    obj: Any, view: np.ndarray, writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    dtype = dtypes.known_numpy(view.dtype)  # the common dtypes, without from_numpy's checks
    if dtype is None:
        try:
            dtype = dtypes.from_numpy(view.dtype)
        except TypeError as exc:
            raise _dtype_error(obj, exc, arg, op, rank) from None
    return _wrap(obj, view, dtype, "cpu", writable, arg, op, rank)


def _export_error(obj: Any, exc: BaseException, arg: str, op: str, rank: int | None) -> TypeError:
    if getattr(obj, "requires_grad", False) is True:
        return TypeError(
            f"{op}: argument '{arg}'{_on_rank(rank)} is a tensor that requires grad "
            f"({_type_name(obj)}); DLPack cannot export it. Pass tensor.detach() instead."
        )
    return TypeError(
        f"{op}: argument '{arg}'{_on_rank(rank)} ({_type_name(obj)}) could not be exported "
        f"through DLPack: {exc}"
    )


def _announces_bf16(obj: Any) -> bool:
    """Whether ``obj.dtype`` says bfloat16 (torch, JAX, ml_dtypes, colls), without importing."""
    try:
        dtype = getattr(obj, "dtype", None)
        return dtype is not None and (dtype is dtypes.BFLOAT16 or str(dtype) in _BF16_NAMES)
    except Exception:  # a producer's dtype property may raise; DLPack still says what it is
        return False


def _import_cpu(
    obj: Any, _device_type: int, writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    if not _announces_bf16(obj):  # NumPy refuses bfloat16: do not make the producer export twice
        try:
            view = np.from_dlpack(obj)
        except _NUMPY_DLPACK_ERRORS:
            view = None  # an unknown dtype, or the producer refused: the ctypes consumer says which
        if view is not None:
            return _from_ndarray(obj, view, writable, arg, op, rank)
    try:
        imported = dlc.import_dlpack(obj)
    except TypeError as exc:
        raise _dtype_error(obj, exc, arg, op, rank) from None
    except Exception as exc:  # the producer's own failure, e.g. torch's requires_grad BufferError
        raise _export_error(obj, exc, arg, op, rank) from exc
    return _wrap(obj, imported.to_numpy(), imported.dtype, "cpu", writable, arg, op, rank)


def _import_cuda(
    obj: Any, _device_type: int, writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    if writable and _framework(obj) == "jax":
        # JAX arrays are immutable, but JAX exports a legacy capsule without the read-only
        # flag, and CuPy would not read the flag anyway: refuse before writing into one.
        raise _read_only_error(obj, arg, op, rank)
    try:
        import cupy
    except ImportError:
        raise TypeError(
            f"{op}: argument '{arg}'{_on_rank(rank)} is a CUDA array ({_type_name(obj)}); colls "
            "needs cupy for CUDA arrays (pip install cupy-cuda12x)"
        ) from None
    try:
        view = cupy.from_dlpack(obj)
    except Exception as exc:  # bfloat16 or another dtype cupy lacks: read the capsule ourselves
        if getattr(obj, "requires_grad", False) is True:
            raise _export_error(obj, exc, arg, op, rank) from exc
        view, dtype, readonly = _cuda_view_via_ctypes(cupy, obj, arg, op, rank)
        if writable and readonly:
            raise _read_only_error(obj, arg, op, rank) from None
    else:
        try:
            dtype = dtypes.from_numpy(view.dtype)
        except TypeError as exc:
            raise _dtype_error(obj, exc, arg, op, rank) from None
    # CuPy arrays have no read-only flag: the capsule's flag was checked above.
    return _wrap(obj, view, dtype, "cuda", False, arg, op, rank)


def _cuda_view_via_ctypes(
    cupy: Any, obj: Any, arg: str, op: str, rank: int | None
) -> tuple[Any, DType, bool]:
    """Wrap CUDA memory from a capsule as a CuPy array of holding dtype (zero copy)."""
    with cupy.cuda.Device(obj.__dlpack_device__()[1]):  # the consumer's stream on its device
        stream = cupy.cuda.get_current_stream().ptr or _CUDA_LEGACY_DEFAULT_STREAM

    class _WithStream:  # make the producer order its work before ours, as the spec asks
        def __dlpack__(self, **kwargs: Any) -> Any:
            kwargs.pop("stream", None)
            return obj.__dlpack__(stream=stream, **kwargs)

    try:
        imported = dlc.import_dlpack(_WithStream())
    except TypeError as exc:
        raise _dtype_error(obj, exc, arg, op, rank) from None
    except Exception as exc:
        raise _export_error(obj, exc, arg, op, rank) from exc
    low, high = imported.span()
    memory = cupy.cuda.UnownedMemory(low, high - low, imported, imported.device[1])
    pointer = cupy.cuda.MemoryPointer(memory, imported.data - low)
    view = cupy.ndarray(imported.shape, imported.dtype.numpy, pointer, imported.strides)
    return view, imported.dtype, imported.readonly


# The kinds :func:`classify` tells apart, each imported by one function of _IMPORTERS.
NDARRAY: Final = "ndarray"
DLPACK_CPU: Final = "dlpack-cpu"
DLPACK_CUDA: Final = "dlpack-cuda"
DLPACK_OTHER: Final = "dlpack-other"
DLPACK_BROKEN: Final = "dlpack-broken"
BUFFER_PROTOCOL: Final = "buffer"
#: Where the memory of each kind lives ("cpu", "cuda"); None: a device colls does not serve.
KIND_DEVICES: Final = {
    NDARRAY: "cpu", DLPACK_CPU: "cpu", DLPACK_CUDA: "cuda", BUFFER_PROTOCOL: "cpu",
    DLPACK_OTHER: None, DLPACK_BROKEN: None,
}  # fmt: skip


def classify(obj: Any) -> tuple[str, Any]:
    """Return ``(kind, detail)``: how :func:`as_buffer` imports ``obj``. Never raises.

    ``detail`` is the DLPack device type for ``dlpack-*`` kinds (for ``dlpack-broken``, the
    exception ``__dlpack_device__`` raised) and None otherwise. A producer is asked for its
    device here and nowhere else.
    """
    if isinstance(obj, np.ndarray):
        return NDARRAY, None
    if not hasattr(obj, "__dlpack__"):
        return BUFFER_PROTOCOL, None
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return DLPACK_CPU, dlc.KDL_CPU  # a producer that does not say: host memory
    try:
        device_type = int(device()[0])
    except Exception as exc:  # the producer's failure; as_buffer names it
        return DLPACK_BROKEN, exc
    if device_type in _CPU_DEVICES:
        return DLPACK_CPU, device_type
    if device_type in _CUDA_DEVICES:
        return DLPACK_CUDA, device_type
    return DLPACK_OTHER, device_type


def device_of(obj: Any) -> str | None:
    """Return where ``obj``'s memory lives, "cpu" or "cuda", without importing it.

    Asks ``__dlpack_device__`` only, so it needs no CuPy: the core checks a CUDA array against
    the group's backend before anything imports it. None when the answer is neither (another
    DLPack device, or a producer whose ``__dlpack_device__`` fails): :func:`as_buffer` then
    raises its own error naming the device or the failure.
    """
    if isinstance(obj, Buffer):
        return obj.device
    return KIND_DEVICES[classify(obj)[0]]


def _import_ndarray(
    obj: Any, _detail: Any, writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    view = obj if type(obj) is np.ndarray else obj.view(np.ndarray)  # subclasses: memmap, ...
    dtype = dtypes.known_numpy(view.dtype)
    if dtype is None:
        return _from_ndarray(obj, view, writable, arg, op, rank)
    flags = view.flags
    if flags.c_contiguous and (flags.writeable or not writable):  # _wrap's common case
        return Buffer(obj, view if view.ndim == 1 else view.reshape(-1), dtype, view.shape, "cpu")
    return _wrap(obj, view, dtype, "cpu", writable, arg, op, rank)


def _import_other_device(
    obj: Any, device_type: int, _writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    name = _DEVICE_NAMES.get(device_type, "unknown")
    raise TypeError(
        f"{op}: argument '{arg}'{_on_rank(rank)} ({_type_name(obj)}) lives on DLPack device "
        f"type {device_type} ({name}); colls handles CPU and CUDA memory only"
    )


def _import_broken(
    obj: Any, exc: Exception, _writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    raise _export_error(obj, exc, arg, op, rank) from exc


def _import_buffer_protocol(
    obj: Any, _detail: Any, writable: bool, arg: str, op: str, rank: int | None
) -> Buffer:
    try:
        view = np.asarray(memoryview(obj))
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise TypeError(
            f"{op}: argument '{arg}'{_on_rank(rank)} must be an array supporting DLPack or the "
            f"buffer protocol, got {_type_name(obj)} ({exc})"
        ) from None
    return _from_ndarray(obj, view, writable, arg, op, rank)


def as_buffer(
    obj: Any, *, writable: bool, arg: str, op: str, rank: int | None = None,
    kind: tuple[str, Any] | None = None,
) -> Buffer:  # fmt: skip
    """Import a caller's array as a :class:`Buffer`, zero copy whenever possible.

    Args:
        obj: Any object with ``__dlpack__`` or the buffer protocol.
        writable: True for arguments a collective writes into (in-place ops, outputs).
        arg: The argument's name, for errors ("tensor", "tensor_list[2]").
        op: The collective's name, for errors ("all_reduce").
        rank: The caller's rank, for errors (omitted from messages when None).
        kind: ``classify(obj)``, when the caller has it already (the core's device check).

    Returns:
        The Buffer; if ``staged``, call ``write_back()`` after writing into ``array``.

    Raises:
        TypeError: unsupported object, device or dtype; read-only while ``writable``; a tensor
            that requires grad; CUDA memory without CuPy.
    """
    name, detail = classify(obj) if kind is None else kind
    return _IMPORTERS[name](obj, detail, writable, arg, op, rank)


def as_buffers(
    objs: Sequence[Any], *, writable: bool, arg: str, op: str, rank: int | None = None
) -> list[Buffer]:
    """Import a list of arrays; errors name the element ("tensor_list[2]").

    Raises:
        TypeError: ``objs`` is not a list or tuple, or any element is refused by :func:`as_buffer`.
    """
    if not isinstance(objs, (list, tuple)):
        raise TypeError(
            f"{op}: argument '{arg}'{_on_rank(rank)} must be a list of arrays, got "
            f"{_type_name(objs)}"
        )
    return [
        as_buffer(item, writable=writable, arg=f"{arg}[{i}]", op=op, rank=rank)
        for i, item in enumerate(objs)
    ]


#: One importer per kind of :func:`classify`: ``importer(obj, detail, writable, arg, op, rank)``.
_IMPORTERS: Final = {
    NDARRAY: _import_ndarray,
    DLPACK_CPU: _import_cpu,
    DLPACK_CUDA: _import_cuda,
    DLPACK_OTHER: _import_other_device,
    DLPACK_BROKEN: _import_broken,
    BUFFER_PROTOCOL: _import_buffer_protocol,
}


def apart_from(array: Any, other: Any) -> Any:
    """Return ``array``, or a copy of it when its memory overlaps ``other``'s.

    torch lets an input alias an output: an in-place ``all_gather_into_tensor`` passes the rank's
    own slot of the output as the input, and nothing stops ``all_to_all_single(x, x)``. The core
    hands backends an input and an output that never overlap: MPI refuses aliased buffers, and
    an algorithm may overwrite output it has not yet read as input. The check is on address
    ranges (``may_share_memory``), so it costs no pass over the data.
    """
    xp = _module_of(array)
    return array.copy() if xp.may_share_memory(array, other) else array


def empty_array(shape: tuple[int, ...] | int, dtype: DType, device: str = "cpu") -> Any:
    """Return an uninitialised C-contiguous array of ``dtype``'s holding type on ``device``."""
    if device == "cpu":
        return np.empty(shape, dtype=dtype.numpy)
    if device == "cuda":
        import cupy

        return cupy.empty(shape, dtype=dtype.numpy)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def scratch(
    buf: Buffer, *, numel: int | None = None, shape: tuple[int, ...] | None = None
) -> Buffer:
    """Return a new writable Buffer of ``buf``'s dtype: a copy of it, or ``numel`` empty elements.

    colls' own layers (functional, multigpu) run the in-place collectives on such buffers; they
    keep the colls dtype, which a bare NumPy array of bfloat16 words could not.
    """
    if numel is None:
        array = buf.array.copy()
        shape = buf.shape if shape is None else shape
    else:
        array = empty_array(numel, buf.dtype, buf.device)
    return Buffer(obj=array, array=array, dtype=buf.dtype,
                  shape=shape if shape is not None else (int(array.size),), device=buf.device)


def empty_like_buffer(buf: Buffer, shape: tuple[int, ...] | None = None) -> Any:
    """Return a new flat array of ``buf``'s dtype and device (``prod(shape)`` elements if given)."""
    count = buf.numel if shape is None else int(np.prod(shape, dtype=np.int64))
    return empty_array(count, buf.dtype, buf.device)


def _framework(template: Any) -> str:
    module = type(template).__module__
    for prefix in ("torch", "jaxlib", "jax", "cupy"):
        if module == prefix or module.startswith(prefix + "."):
            return "jax" if prefix == "jaxlib" else prefix
    return "numpy"


def new_array_like(
    template: Any,
    result: Any,
    shape: tuple[int, ...] | None = None,
    *,
    dtype: DType | None = None,
) -> Any:
    """Return a new array of ``template``'s framework holding ``result``'s data.

    Used by ``colls.functional`` to hand results back in the caller's array type.

    Args:
        template: An array of the framework to produce (numpy, torch, jax, cupy; anything else
            gives NumPy).
        result: NumPy (or CuPy) array of holding dtype (bfloat16 as uint16 words).
        shape: Shape of the returned array (default ``result.shape``).
        dtype: The colls dtype of ``result`` (default: ``template``'s dtype).

    Returns:
        A new array; for torch CPU it shares memory with ``result``.
    """
    if dtype is None:
        dtype = dtypes.from_any(template)
    module = _module_of(result) if not isinstance(result, np.ndarray) else np
    words = module.ascontiguousarray(result)
    if shape is not None:
        words = words.reshape(shape)
    framework = _framework(template)
    if framework == "torch":
        return _to_torch(words, dtype)
    if framework == "jax":
        return _to_jax(words, dtype)
    if framework == "cupy":
        import cupy

        return cupy.asarray(words)
    if dtype is dtypes.BFLOAT16 and isinstance(getattr(template, "dtype", None), np.dtype):
        if template.dtype.name == "bfloat16":  # ml_dtypes bfloat16 in, ml_dtypes out
            return words.view(template.dtype)
    return words


def _to_torch(words: Any, dtype: DType) -> Any:
    import torch
    import torch.utils.dlpack

    bf16 = dtype is dtypes.BFLOAT16
    if bf16:
        words = words.view(np.int16)  # int16 exists in every torch; the view is a bitcast
    if isinstance(words, np.ndarray):
        tensor = torch.from_numpy(words)
    else:  # CuPy: torch reads CUDA memory through DLPack
        tensor = torch.utils.dlpack.from_dlpack(words)
    return tensor.view(torch.bfloat16) if bf16 else tensor


def _to_jax(words: Any, dtype: DType) -> Any:
    import jax.numpy as jnp

    if not isinstance(words, np.ndarray):  # CuPy result
        import jax.dlpack

        array = jax.dlpack.from_dlpack(words)
        return array.view(jnp.bfloat16) if dtype is dtypes.BFLOAT16 else array
    if dtype is dtypes.BFLOAT16:
        words = words.view(jnp.bfloat16)  # ml_dtypes' bfloat16, which JAX uses
    return jnp.asarray(words)
