"""The zero-copy jit path: each colls_jax collective as an ordered XLA FFI custom call.

Inside ``jax.jit`` a collective becomes a custom call to the target ``colls_jax_call``, whose
handler is the optional C extension ``colls_jax._ffi_native``. XLA calls the handler with
pointers to its own buffers; the handler wraps them in memoryviews (no copy) and calls the call
site's host runner (registered by :func:`add_site`, found by the call's ``key``) with them,
which views them as NumPy arrays and runs the collective's host function
(:mod:`colls_jax._host`) on them: the core reads XLA's input buffer and writes XLA's output
buffer. Collectives that reduce in place (all_reduce, broadcast, reduce) alias their output to
their input (``input_output_aliases``), so when XLA can donate the input the result is computed
in that very buffer.

On XLA's CUDA platform the same target has the extension's device handler: XLA's buffers are
device memory, so the handler passes them as (pointer, bytes) pairs with the stream the call
runs on and the device's ordinal, and :func:`_dispatch_device` views them as CuPy arrays (no
copy) and runs the same host function with that stream current (CuPy's ``ExternalStream``). The
core then orders its work on XLA's stream, as it does on any caller's current stream: nccl
enqueues after it and makes it wait on the result, with no host synchronisation; a host
transport (tcp, mpi without CUDA support) stages through host memory. Not yet run on a GPU
(docs/gpu.md).

Order. A custom call with ``has_side_effect=True`` is never removed as dead code, but XLA may
still run two independent ones in any order, and two ranks could then deadlock. So the call
carries an *ordered effect* (:class:`CollsEffect`, registered as JAX's ordered effects are):
JAX threads one token through every ordered effect of a program, in trace order, and across
consecutive jitted programs; the token is an operand and a result of each custom call, so XLA
cannot reorder them. ``jax.ffi.ffi_call`` has no ordered form in jax 0.10 (its ``FfiEffect``
is unordered), hence this small primitive, lowered with ``jax.ffi.ffi_lowering`` as mpi4jax
lowers its own.

Which path runs: :func:`load` returns this module's :func:`call` when the extension is built
and JAX has what it needs (``COLLS_JAX_JIT=callback`` forces the fallback); otherwise the
ordered host callback of :mod:`colls_jax._jit` runs. ``COLLS_DEBUG=info`` prints which path
was chosen and why, once per process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from colls import env

logger = logging.getLogger("colls.jax")

TARGET = "colls_jax_call"
#: The interface of ``_ffi_native.c`` this module speaks (its ``INTERFACE``).
INTERFACE = 3
#: ``COLLS_JAX_JIT``: auto (FFI when it loads, else callbacks) | ffi | callback.
PATHS = ("auto", "ffi", "callback")
#: JAX's lowering platforms of the custom call (XLA's CPU and CUDA platforms have handlers).
PLATFORMS = ("cpu", "cuda")

#: Views one of XLA's device buffers, a (pointer, bytes) pair, as an array of an aval's shape
#: and dtype.
Viewer = Callable[[Any, Any], Any]
#: One call site on the device: runs its collective on XLA's input and output buffers, viewed by
#: the Viewer.
Runner = Callable[[tuple[Any, ...], tuple[Any, ...], Viewer], None]

# Call sites staged so far, indexed by the custom call's ``key`` attribute: the host runners
# (called by the C handler with a memoryview of each buffer) and the device runners. Only
# appended to (under the lock), so a compiled program's key stays valid for the life of the
# process.
_host_sites: list[Callable[..., None]] = []
_device_sites: list[Runner] = []
_sites_lock = threading.Lock()


def _dispatch_device(key: int, ins: tuple[tuple[int, int], ...],
                     outs: tuple[tuple[int, int], ...], stream: int, device: int) -> None:
    """Run call site ``key`` on XLA's CUDA buffers, ordered on XLA's ``stream`` (called by the
    C device handler, GIL held; ``device`` is the ordinal, -1 when XLA's API cannot say)."""
    import cupy

    if device < 0:
        device = cupy.cuda.runtime.getDevice()
    view = _DeviceViewer(cupy, device)
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream, device):
        _device_sites[key](ins, outs, view)


def add_site(host: Callable[..., None], ins: tuple[Any, ...], outs: tuple[Any, ...],
             alias: bool = False) -> int:
    """Register the call site of ``host(*inputs, *outputs)`` on arrays of the avals ``ins`` and
    ``outs`` (shape, dtype; fixed at trace time); return its key (the custom call's ``key``).

    With ``alias`` the output is the input's buffer (``input_output_aliases``): the one array
    is passed as both, so the host function sees that they are the same array.
    """
    host_run = _host_runner(host, tuple(ins), tuple(outs), alias)
    device_run = _device_runner(host, tuple(ins), tuple(outs), alias)
    with _sites_lock:
        _host_sites.append(host_run)
        _device_sites.append(device_run)
        return len(_host_sites) - 1


def _host_runner(host: Callable[..., None], ins: tuple[Any, ...], outs: tuple[Any, ...],
                 alias: bool) -> Callable[..., None]:
    """Return what the C handler calls, with a memoryview of each of XLA's host buffers.

    Each buffer is viewed as a writable NumPy array by one ``ndarray`` constructor (half the
    time of ``frombuffer`` + ``reshape``). The runners of one and two buffers are written out:
    every collective of a jitted program runs one, and a comprehension over the avals costs a
    frame and a list per call.
    """
    ndarray = np.ndarray
    if alias:
        shape, dtype = outs[0].shape, outs[0].dtype

        def run_aliased(_input: memoryview, output: memoryview) -> None:
            out = ndarray(shape, dtype, output)
            host(out, out)

        return run_aliased
    avals = [(a.shape, a.dtype) for a in (*ins, *outs)]
    if len(avals) == 1:
        [(shape, dtype)] = avals

        def run_one(buffer: memoryview) -> None:
            host(ndarray(shape, dtype, buffer))

        return run_one
    if len(avals) == 2:
        [(shape0, dtype0), (shape1, dtype1)] = avals

        def run_two(first: memoryview, second: memoryview) -> None:
            host(ndarray(shape0, dtype0, first), ndarray(shape1, dtype1, second))

        return run_two

    def run(*buffers: memoryview) -> None:
        host(*[ndarray(shape, dtype, buffer)
               for (shape, dtype), buffer in zip(avals, buffers, strict=True)])

    return run


class _DeviceViewer:
    """Views XLA's device buffers of one device as CuPy arrays, without a copy.

    The memory stays XLA's: CuPy neither owns nor frees it, and the arrays live only for the
    call (the core keeps what it enqueued alive until its event fires, within that call's
    stream order).
    """

    def __init__(self, cupy: Any, device: int) -> None:
        self._cupy = cupy
        self._device = device

    def __call__(self, buffer: tuple[int, int], aval: Any) -> Any:
        cupy = self._cupy
        pointer, nbytes = buffer
        if nbytes == 0:
            return cupy.empty(aval.shape, dtype=aval.dtype)
        memory = cupy.cuda.UnownedMemory(pointer, nbytes, None, self._device)
        return cupy.ndarray(aval.shape, dtype=aval.dtype,
                            memptr=cupy.cuda.MemoryPointer(memory, 0))


def _device_runner(host: Callable[..., None], ins: tuple[Any, ...], outs: tuple[Any, ...],
                   alias: bool) -> Runner:
    """Return the device runner of one call site: ``host(*inputs, *outputs)`` on the device
    buffers, viewed by the Viewer the device dispatcher passes."""

    def run_aliased(in_buffers: tuple[Any, ...], out_buffers: tuple[Any, ...], view: Viewer
                    ) -> None:
        out = view(out_buffers[0], outs[0])
        host(out, out)

    if alias:
        return run_aliased

    def run(in_buffers: tuple[Any, ...], out_buffers: tuple[Any, ...], view: Viewer) -> None:
        arrays = [view(b, a) for b, a in zip(in_buffers, ins, strict=True)]
        arrays += [view(b, a) for b, a in zip(out_buffers, outs, strict=True)]
        host(*arrays)

    return run


# -- the primitive: ordered effect, abstract eval, lowering -------------------------------------


def _build_primitive() -> Callable[..., list[Any]]:
    """Define the ordered effect and the primitive; return ``bind`` (raises if JAX lacks them)."""
    from jax._src import dispatch, effects
    from jax._src.core import abstract_token
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    class CollsEffect(effects.Effect):
        """The ordered side effect of a colls_jax collective."""

        def __str__(self) -> str:
            return "colls_jax"

    effect = CollsEffect()
    for registry in (effects.lowerable_effects, effects.ordered_effects,
                     effects.control_flow_allowed_effects,
                     effects.custom_derivatives_allowed_effects):
        registry.add_type(CollsEffect)

    prim = Primitive("colls_jax_call")
    prim.multiple_results = True

    def abstract_eval(*avals: Any, key: int, results: tuple[Any, ...], alias: bool
                      ) -> tuple[tuple[Any, ...], set[Any]]:
        del avals, key, alias
        return results, {effect}

    def lowering(ctx: Any, *operands: Any, key: int, results: tuple[Any, ...], alias: bool
                 ) -> list[Any]:
        del results
        token = ctx.tokens_in.get(effect)
        with_token = ctx.replace(avals_in=(*ctx.avals_in, abstract_token),
                                 avals_out=(*ctx.avals_out, abstract_token))
        rule = jax.ffi.ffi_lowering(TARGET, has_side_effect=True,
                                    operand_output_aliases={0: 0} if alias else None)
        values = list(rule(with_token, *operands, token, key=np.int64(key)))
        ctx.set_tokens_out(mlir.TokenSet({effect: values.pop()}))
        return values

    prim.def_impl(lambda *args, **params: dispatch.apply_primitive(prim, *args, **params))
    prim.def_effectful_abstract_eval(abstract_eval)
    for platform in PLATFORMS:
        mlir.register_lowering(prim, lowering, platform=platform)

    def bind(*args: Any, key: int, results: tuple[Any, ...], alias: bool) -> list[Any]:
        return prim.bind(*args, key=key, results=results, alias=alias)  # type: ignore[no-any-return]

    return bind


# -- loading ------------------------------------------------------------------------------------

_state: dict[str, Any] = {}


def _try_load() -> tuple[Callable[..., list[Any]] | None, str]:
    """Return (bind, why) for the FFI path, or (None, why not)."""
    choice = os.environ.get("COLLS_JAX_JIT", "auto").strip().lower() or "auto"
    if choice not in PATHS:
        raise ValueError(f"colls_jax: COLLS_JAX_JIT must be one of {', '.join(PATHS)}, "
                         f"got {choice!r}")
    if choice == "callback":
        return None, "COLLS_JAX_JIT=callback"
    backend = jax.default_backend()
    blocked = _platform_blocked(backend)
    if blocked is not None:
        return None, blocked
    try:
        from colls_jax import _ffi_native
    except ImportError as exc:
        return None, f"the extension colls_jax._ffi_native is not built ({exc})"
    if getattr(_ffi_native, "INTERFACE", None) != INTERFACE:
        return None, (f"{_ffi_native.__file__} has interface "
                      f"{getattr(_ffi_native, 'INTERFACE', None)}, not {INTERFACE} "
                      "(built from an older _ffi_native.c; reinstall colls to rebuild it)")
    try:
        if "built" not in _state:  # once per process: JAX keeps primitives and targets
            _state["built"] = _build_primitive()
            jax.ffi.register_ffi_target(TARGET, _ffi_native.handler(), platform="cpu")
            jax.ffi.register_ffi_target(TARGET, _ffi_native.device_handler(), platform="CUDA")
        bind = _state["built"]
    except Exception as exc:  # a JAX without these internals: the callbacks still work
        return None, f"this JAX ({jax.__version__}) cannot host it ({type(exc).__name__}: {exc})"
    _ffi_native.set_device_dispatch(_dispatch_device)
    _ffi_native.set_sites(_host_sites)
    where = "CUDA handler, not yet run on a GPU" if backend == "gpu" else "CPU handler"
    return bind, f"XLA FFI custom call {TARGET!r}, {where} ({_ffi_native.__file__})"


def _platform_blocked(backend: str) -> str | None:
    """Return why JAX's default ``backend`` cannot take the FFI path, or None if it can."""
    if backend == "cpu":
        return None
    if backend != "gpu":
        return f"JAX's default backend is {backend!r}; the FFI handlers are for CPU and CUDA"
    client = getattr(jax.devices()[0], "client", None)
    version = str(getattr(client, "platform_version", "")).lower()
    if "rocm" in version:
        return f"JAX runs on ROCm ({version}); the FFI device handler is for CUDA"
    try:
        import cupy  # noqa: F401
    except ImportError as exc:
        return (f"JAX runs on a GPU but CuPy cannot be imported ({exc}); the CUDA handler views "
                "XLA's buffers as CuPy arrays")
    return None


def load() -> Callable[..., list[Any]] | None:
    """Return the primitive's ``bind`` if the FFI path is used in this process, else None.

    Decided once per process, at the first collective staged into a trace.
    """
    if "bind" not in _state:
        bind, why = _try_load()
        if bind is None and os.environ.get("COLLS_JAX_JIT", "").strip().lower() == "ffi":
            raise RuntimeError(f"colls_jax: COLLS_JAX_JIT=ffi but the FFI path cannot load: "
                               f"{why}")
        _state["bind"], _state["why"] = bind, why
        path = "ffi" if bind is not None else "callback"
        message = f"colls_jax: jit path: {path}: {why}"
        logger.info(message)
        if env.get("COLLS_DEBUG") != "off":
            print(message, file=sys.stderr, flush=True)
    return _state["bind"]  # type: ignore[no-any-return]


def reset() -> None:
    """Forget the path chosen, so that the next staged collective reads ``COLLS_JAX_JIT`` again.

    For tests that run both paths in one process; functions JAX already compiled keep theirs
    (``jax.clear_caches()`` drops them).
    """
    _state.pop("bind", None)
    _state.pop("why", None)


def path() -> str:
    """Return "ffi" or "callback": the path jitted collectives take in this process."""
    return "ffi" if load() is not None else "callback"


def why() -> str:
    """Return why that path was chosen."""
    load()
    return str(_state["why"])
