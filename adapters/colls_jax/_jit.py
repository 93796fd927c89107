"""Run a host collective eagerly, or inside a JAX trace as an ordered XLA FFI custom call (or,
as the fallback, an *ordered* host callback).

Why ordered: a collective is a side effect that every rank must perform in the same
order. XLA schedules independent operations freely, so two unrelated collectives of one jitted
function could run in a different order on two ranks, and both ranks would wait forever. JAX's
public ``jax.experimental.io_callback(..., ordered=True)`` gives each callback an *ordered
effect*: JAX threads one token through every ordered callback of a program, in the order they
were traced, and through consecutive executions of jitted programs (runtime tokens), so every
rank runs them in program order. Ordered effects are never removed as dead code either: a
collective whose result is unused still runs on every rank.

Three paths, chosen per call:

* eager code: run the host function directly, after ``jax.effects_barrier()`` so that
  callbacks of jitted code dispatched earlier (which run asynchronously) have finished; that
  keeps eager and jitted collectives in one order on every rank.
* inside a trace (jit, grad, vmap, scan, ...): the ordered FFI custom call of
  :mod:`colls_jax._ffi` on XLA's own buffers when it loads, else
  ``io_callback(..., ordered=True)`` (NumPy copies in and out); either wrapped in
  ``custom_vmap``, whose rule maps a batched call onto one collective of the whole batch (the
  batch axis is moved where the collective does not split or stack, then moved back to axis 0).
* a device-mapped trace (pmap, shard_map, vmap with axis_name): refused, since a host collective
  would run once per device instead of once per process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback

from colls_jax import _ffi

Shape = tuple[int, ...]


@dataclass(frozen=True)
class HostOp:
    """One collective with its static arguments bound, as the dispatcher runs it.

    Attributes:
        name: The public name, for errors ("all_gather").
        host: Host function ``host(x, out)`` writing the result into ``out`` (``host(x)`` when
            there is no output), as in :mod:`colls_jax._host`.
        shape: Output shape as a function of the input shape; None when there is no output.
        in_axis: Under vmap, the axis the batch axis is moved to in the input (1 for ops that
            split or concatenate axis 0, so that axis stays axis 0).
        out_axis: Under vmap, the axis of the output where the batch axis then is.
        batchable: False for ops whose batched meaning is unclear (send): vmap raises.
        in_place: True for ops that compute in their output buffer starting from the input
            (all_reduce, broadcast, reduce): on the FFI path the output aliases the input.
    """

    name: str
    host: Callable[[Any], Any]
    shape: Callable[[Shape], Shape] | None
    in_axis: int = 0
    out_axis: int = 0
    batchable: bool = True
    in_place: bool = False


_Tracer = jax.core.Tracer


def is_traced(x: Any) -> bool:
    """Return True if ``x`` is a JAX tracer (inside jit, grad, vmap, ...)."""
    return isinstance(x, _Tracer)


def _find_trace_state_clean() -> Callable[[], bool] | None:
    try:
        from jax._src.core import trace_state_clean
    except ImportError:
        return None
    return trace_state_clean  # type: ignore[no-any-return]


_TRACE_STATE_CLEAN = _find_trace_state_clean()


def tracing() -> bool:
    """Return True while JAX traces a function (jit, grad, vmap, scan, ...).

    Not the same as "an argument is a tracer": a concrete array captured by a jitted function's
    closure is not a tracer, yet a collective on it must be staged into the program (run on
    every call, in order), not run once while tracing. JAX's cheap private check is used when
    it exists; otherwise a public probe (inside a trace every new value is a tracer).
    """
    if _TRACE_STATE_CLEAN is not None:
        return not _TRACE_STATE_CLEAN()
    return is_traced(jnp.zeros((), jnp.int32))


def call(op: HostOp, x: jax.Array) -> jax.Array | None:
    """Run ``op`` on ``x``: directly in eager code, staged in order inside a trace."""
    if not is_traced(x) and not tracing():
        jax.effects_barrier()  # earlier jitted collectives first, in the same order everywhere
        out = _run_host(op, x)
        return None if out is None else _to_jax(out)
    check_not_mapped(op.name)
    return _batchable(op)(x)


def call_nullary(name: str, host: Callable[[np.ndarray], None], result: jax.ShapeDtypeStruct
                 ) -> jax.Array:
    """Run an op without array inputs (recv, barrier): ``host(out)``, eager or staged."""
    if not tracing():
        jax.effects_barrier()
        out = np.empty(result.shape, result.dtype)
        host(out)
        return _to_jax(out)
    check_not_mapped(name)
    bind = _ffi.load()
    if bind is not None:
        key = _ffi.add_site(host, (), (result,))
        return bind(key=key, results=(_aval(result),), alias=False)[0]  # type: ignore[no-any-return]

    def allocate() -> np.ndarray:
        out = np.empty(result.shape, result.dtype)
        host(out)
        return out

    return io_callback(allocate, result, ordered=True)


def _run_host(op: HostOp, x: Any) -> np.ndarray | None:
    """Run ``op`` on a concrete ``x``: the input viewed without a copy, a new NumPy output."""
    src = np.asarray(x)
    if op.shape is None:
        op.host(src)
        return None
    if op.in_place:  # the result starts as a copy of the input: make it, then pass it as both
        out = np.array(src)
        op.host(out, out)
        return out
    out = np.empty(op.shape(src.shape), src.dtype)
    op.host(src, out)
    return out


def _to_jax(out: np.ndarray) -> jax.Array:
    """Hand a NumPy result to JAX (one copy into a buffer JAX owns), as ``jnp.asarray`` does.

    ``jnp.asarray`` stages a ``device_put`` primitive through JAX's tracing machinery: about
    45 us per call on the CPU, ten times the core's 8-byte all_reduce. Where JAX's own transfer
    function (:func:`_host_transfer`) is there and the array goes to the default CPU device,
    that function is called directly (about 8 us, its aval cached per shape and dtype), with
    what ``jnp.asarray`` would give: an uncommitted array of the same canonical dtype.
    """
    global _HOST_TRANSFER
    if _HOST_TRANSFER is _UNKNOWN:  # looked up at the first result, not at import: JAX's
        _HOST_TRANSFER = _host_transfer()  # backend must not start before jax.distributed's
    put = _HOST_TRANSFER
    if put is not None and jax.config.jax_default_device is None \
            and jax.dtypes.canonicalize_dtype(out.dtype) == out.dtype:  # what asarray keeps
        return put(out)  # type: ignore[operator]
    return jnp.asarray(out)


def _host_transfer() -> Callable[[np.ndarray], jax.Array] | None:
    """Return JAX's transfer of one host array to the default device when that is a CPU, or
    None (another platform, or a JAX without ``pxla.batched_device_put``: ``jnp.asarray``)."""
    try:
        from jax._src.interpreters.pxla import batched_device_put

        device = jax.devices()[0]
        if device.platform != "cpu":
            return None
        sharding = jax.sharding.SingleDeviceSharding(device)
        devices = [device]
        # A ShapedArray took 1.6 us to make, a cached one 0.2 to find.
        aval_of = functools.lru_cache(maxsize=1024)(jax.core.ShapedArray)

        def put(out: np.ndarray) -> jax.Array:
            return batched_device_put(aval_of(out.shape, out.dtype), sharding, [out], devices,
                                      committed=False)

        probe = np.arange(3, dtype=np.float32)
        if not np.array_equal(np.asarray(put(probe)), probe):
            return None
        return put
    except Exception:  # a JAX whose internals moved: the public path
        return None


_UNKNOWN: Any = object()
_HOST_TRANSFER: Any = _UNKNOWN

def _aval(spec: jax.ShapeDtypeStruct) -> Any:
    return jax.core.ShapedArray(spec.shape, spec.dtype)


def _staged(op: HostOp, x: jax.Array) -> jax.Array | None:
    """Stage ``op`` on traced ``x``: the ordered FFI custom call, or the ordered callback."""
    result = None if op.shape is None else jax.ShapeDtypeStruct(op.shape(x.shape), x.dtype)
    bind = _ffi.load()
    if bind is not None:
        outs = () if result is None else (result,)
        alias = op.in_place and result is not None
        spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
        key = _ffi.add_site(op.host, (spec,), outs, alias=alias)
        values = bind(x, key=key, results=tuple(_aval(r) for r in outs), alias=alias)
        return values[0] if values else None
    return io_callback(lambda v: _run_host(op, v), result, x, ordered=True)


def _batchable(op: HostOp) -> Callable[[jax.Array], Any]:
    """Wrap ``op``'s callback so that vmap runs one collective on the whole batch."""
    fn = custom_vmap(lambda x: _staged(op, x))

    @fn.def_vmap
    def rule(axis_size: int, in_batched: list[bool], x: jax.Array) -> tuple[Any, Any]:
        del axis_size
        if not in_batched[0]:
            return call(op, x), False
        if not op.batchable:
            raise NotImplementedError(
                f"colls_jax.{op.name} cannot be batched with jax.vmap: the receiving rank could "
                "not tell how many messages to expect. Call it outside vmap on the whole batch."
            )
        out = call(op, jnp.moveaxis(x, 0, op.in_axis))
        return jnp.moveaxis(out, op.out_axis, 0), True

    return fn


def _named_axes() -> tuple[Any, ...]:
    """Return the named axes of the current trace (pmap, shard_map, named vmap), if any.

    JAX has no public query for this; the private one is used when it exists, and when a future
    JAX removes it the check is skipped (pmap would then run the callback once per device).
    """
    try:
        from jax._src import core as jax_core

        return tuple(jax_core.get_axis_env().axis_sizes)
    except Exception:  # a JAX without this internal: no check rather than no collectives
        return ()


def check_not_mapped(name: str) -> None:
    """Raise if called inside pmap, shard_map or a vmap with an axis name.

    Raises:
        NotImplementedError: the trace has named axes.
    """
    axes = _named_axes()
    if axes:
        raise NotImplementedError(
            f"colls_jax.{name} was called inside jax.pmap, jax.shard_map or a jax.vmap with "
            f"axis_name (named axes: {', '.join(map(str, axes))}). colls_jax collectives run "
            "once per process on the host, so they cannot be mapped over devices or named "
            "axes. Call colls_jax outside the mapped function (plain jax.vmap is supported), "
            "or use jax.lax collectives (psum, all_gather, ppermute) for device axes."
        )
