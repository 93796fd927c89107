"""Rank functions of the colls_jax tests (module level, so colls.testing.spawn can import them).

Each function runs on every rank of a real tcp world, compares every result with a NumPy
reference (jax_reference) and raises on the first mismatch; it returns how many checks passed
so the test can tell that the checks really ran.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import colls_jax as cj
import jax
import jax.numpy as jnp
import numpy as np
from jax_reference import (
    DTYPES,
    JIT_DTYPES,
    PREMUL_FACTOR,
    REDUCTIONS,
    all_data,
    assert_equal,
    np_dtype,
    reduce,
)

import colls


def _op(name: str) -> Any:
    if name == "PREMUL_SUM":
        return cj.make_premul_sum(PREMUL_FACTOR)
    return getattr(cj.ReduceOp, name)


def _perms(size: int) -> dict[str, list[tuple[int, int]]]:
    return {"reverse": [(r, size - 1 - r) for r in range(size)], "partial": [(0, size - 1)]}


def all_ops(x: jax.Array, xs: jax.Array, *, dtype: str, rank: int, size: int
            ) -> dict[str, jax.Array]:
    """Call every collective on ``x`` (shape (2*size, 3)) and ``xs`` (shape (size, 3))."""
    out: dict[str, jax.Array] = {}
    for op in REDUCTIONS[dtype]:
        out[f"all_reduce/{op}"] = cj.all_reduce(x, _op(op))
        out[f"reduce_scatter_tiled/{op}"] = cj.reduce_scatter(x, _op(op), tiled=True)
    out["reduce_scatter/SUM"] = cj.reduce_scatter(xs)
    for root in range(size):
        out[f"broadcast/{root}"] = cj.broadcast(x, root)
        out[f"reduce/SUM/{root}"] = cj.reduce(x, root)
        out[f"gather/{root}"] = cj.gather(x, root)
        out[f"scatter/{root}"] = cj.scatter(xs, root)
    out["reduce/MAX/0"] = cj.reduce(x, 0, cj.ReduceOp.MAX if dtype != "complex64" else "sum")
    out["all_gather"] = cj.all_gather(x)
    out["all_gather_tiled"] = cj.all_gather(x, tiled=True)
    out["all_to_all"] = cj.all_to_all(x)
    out["shift/1"] = cj.shift(x)
    out["shift/-1"] = cj.shift(x, -1)
    for name, perm in _perms(size).items():
        out[f"ppermute/{name}"] = cj.ppermute(x, perm)
    if rank == 0:
        cj.send(x, size - 1, tag=3)
    if rank == size - 1:
        out["recv"] = cj.recv(x.shape, x.dtype, 0, tag=3)
    cj.barrier()
    return out


def reference(xs_all: list[np.ndarray], x_all: list[np.ndarray], *, dtype: str, rank: int,
              size: int) -> dict[str, np.ndarray]:
    """Return what :func:`all_ops` must give on ``rank``, computed with NumPy."""
    ref: dict[str, np.ndarray] = {}
    rows = x_all[0].shape[0] // size
    block = slice(rank * rows, (rank + 1) * rows)
    zeros = np.zeros_like(x_all[0])
    for op in REDUCTIONS[dtype]:
        reduced = np.asarray(_cast(dtype, _reduce(x_all, op, dtype)))
        ref[f"all_reduce/{op}"] = reduced
        ref[f"reduce_scatter_tiled/{op}"] = reduced[block]
    ref["reduce_scatter/SUM"] = np.asarray(_cast(dtype, _reduce(xs_all, "SUM", dtype)))[rank]
    total = _cast(dtype, _reduce(x_all, "SUM", dtype))
    for root in range(size):
        ref[f"broadcast/{root}"] = x_all[root]
        ref[f"reduce/SUM/{root}"] = total if rank == root else zeros
        ref[f"gather/{root}"] = np.stack(x_all) if rank == root else np.zeros_like(
            np.stack(x_all))
        ref[f"scatter/{root}"] = xs_all[root][rank]
    top = _cast(dtype, _reduce(x_all, "MAX" if dtype != "complex64" else "SUM", dtype))
    ref["reduce/MAX/0"] = top if rank == 0 else zeros
    ref["all_gather"] = np.stack(x_all)
    ref["all_gather_tiled"] = np.concatenate(x_all)
    ref["all_to_all"] = np.concatenate([x_all[i][block] for i in range(size)])
    ref["shift/1"] = x_all[(rank - 1) % size]
    ref["shift/-1"] = x_all[(rank + 1) % size]
    for name, perm in _perms(size).items():
        sources = [s for s, t in perm if t == rank]
        ref[f"ppermute/{name}"] = x_all[sources[0]] if sources else zeros
    if rank == size - 1:
        ref["recv"] = x_all[0]
    return ref


def _reduce(arrays: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    return reduce(arrays, op, dtype)


def _cast(dtype: str, value: np.ndarray) -> np.ndarray:
    return np.asarray(value).astype(np_dtype(dtype))


def _check_all(got: dict[str, Any], ref: dict[str, np.ndarray], dtype: str, mode: str) -> int:
    if sorted(got) != sorted(ref):
        raise AssertionError(f"{mode} {dtype}: results {sorted(got)} != expected {sorted(ref)}")
    for key, value in got.items():
        if not isinstance(value, jax.Array):
            raise AssertionError(f"{mode} {dtype} {key}: got {type(value)}, not a jax.Array")
        assert_equal(value, ref[key], dtype, f"{mode} {dtype} {key}")
    return len(got)


def every_op(rank: int, size: int) -> dict[str, Any]:
    """Every op and dtype eagerly, and under jit for JIT_DTYPES, against NumPy."""
    checks = 0
    for dtype in DTYPES:
        x_all = all_data(size, dtype, (2 * size, 3), salt=1)
        xs_all = all_data(size, dtype, (size, 3), salt=2)
        fn = partial(all_ops, dtype=dtype, rank=rank, size=size)
        ref = reference(xs_all, x_all, dtype=dtype, rank=rank, size=size)
        x, xs = jnp.asarray(x_all[rank]), jnp.asarray(xs_all[rank])
        checks += _check_all(fn(x, xs), ref, dtype, "eager")
        if dtype in JIT_DTYPES:
            checks += _check_all(jax.jit(fn)(x, xs), ref, dtype, "jit")
    checks += _edge_shapes(rank, size)
    checks += _core_functional(rank, size)
    return {"checks": checks, "dtypes": list(DTYPES)}


def _edge_shapes(rank: int, size: int) -> int:
    """0-d and zero-size arrays, eagerly and under jit."""
    checks = 0
    scalars = [np.float32(r + 1) for r in range(size)]
    empty = np.zeros((0, 3), np.float32)
    for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        got = wrap(cj.all_reduce)(jnp.float32(rank + 1))
        assert_equal(got, np.float32(sum(scalars)), "float32", f"{mode} 0-d all_reduce")
        got = wrap(cj.all_gather)(jnp.float32(rank + 1))
        assert_equal(got, np.array(scalars), "float32", f"{mode} 0-d all_gather")
        got = wrap(cj.gather)(jnp.float32(rank + 1))
        assert_equal(got, np.array(scalars) if rank == 0 else np.zeros(size, np.float32),
                     "float32", f"{mode} 0-d gather")
        assert_equal(wrap(cj.all_reduce)(jnp.asarray(empty)), empty, "float32",
                     f"{mode} empty all_reduce")
        got = wrap(partial(cj.all_gather, tiled=True))(jnp.asarray(empty))
        assert_equal(got, empty, "float32", f"{mode} empty all_gather")
        checks += 5
    return checks


def _core_functional(rank: int, size: int) -> int:
    """colls.functional (the core's own functional API) on JAX arrays returns JAX arrays."""
    checks = 0
    for dtype in ("float32", "bfloat16", "int32"):
        x_all = all_data(size, dtype, (4, 2), salt=3)
        got = colls.functional.all_reduce(jnp.asarray(x_all[rank]))
        if not isinstance(got, jax.Array):
            raise AssertionError(f"colls.functional.all_reduce returned {type(got)}")
        assert_equal(got, _cast(dtype, _reduce(x_all, "SUM", dtype)), dtype,
                     f"colls.functional.all_reduce {dtype}")
        got = colls.functional.all_gather(jnp.asarray(x_all[rank]))
        assert_equal(got, np.stack(x_all), dtype, f"colls.functional.all_gather {dtype}")
        checks += 2
    return checks


def _vmapped(size: int, rank: int) -> list[tuple[str, Callable[..., Any], Any, np.ndarray]]:
    """(name, per-example function, batched input, expected batched output) for vmap."""
    batch = 4
    x_all = all_data(size, "float32", (batch, 2 * size, 3), salt=4)
    xs_all = [x[:, :size] for x in x_all]
    rows = 2
    block = slice(rank * rows, (rank + 1) * rows)
    per_b = range(batch)
    return [
        ("all_reduce", cj.all_reduce, x_all[rank], sum(x_all)),
        ("all_gather", cj.all_gather, x_all[rank], np.stack(x_all, axis=1)),
        ("all_gather_tiled", partial(cj.all_gather, tiled=True), x_all[rank],
         np.concatenate(x_all, axis=1)),
        ("reduce_scatter", cj.reduce_scatter, xs_all[rank], sum(xs_all)[:, rank]),
        ("reduce_scatter_tiled", partial(cj.reduce_scatter, tiled=True), x_all[rank],
         sum(x_all)[:, block]),
        ("all_to_all", cj.all_to_all, x_all[rank],
         np.stack([np.concatenate([x_all[i][b, block] for i in range(size)]) for b in per_b])),
        ("gather", cj.gather, x_all[rank],
         np.stack(x_all, axis=1) if rank == 0 else np.zeros((batch, size, 2 * size, 3))),
        ("scatter", partial(cj.scatter, src=size - 1), xs_all[rank], xs_all[size - 1][:, rank]),
        ("shift", cj.shift, x_all[rank], x_all[(rank - 1) % size]),
        ("nested all_reduce", jax.vmap(cj.all_reduce), x_all[rank].reshape(2, 2, -1, 3),
         sum(x_all).reshape(2, 2, -1, 3)),
    ]


def vmapped_ops(rank: int, size: int) -> dict[str, Any]:
    """jax.vmap (eager and under jit) maps each op onto one collective of the whole batch."""
    checks = 0
    for name, fn, x, expected in _vmapped(size, rank):
        for mode, wrap in (("vmap", jax.vmap), ("jit(vmap)", lambda f: jax.jit(jax.vmap(f)))):
            got = wrap(fn)(jnp.asarray(x))
            assert_equal(got, np.asarray(expected, np.float32), "float32", f"{mode} {name}")
            checks += 1
    try:
        jax.vmap(lambda v: cj.send(v, (rank + 1) % size))(jnp.zeros((2, 3)))
    except NotImplementedError as exc:
        if "cannot be batched with jax.vmap" not in str(exc):
            raise
        checks += 1
    else:
        raise AssertionError("send under vmap did not raise")
    return {"checks": checks}


def subgroup_ops(rank: int, size: int) -> dict[str, Any]:
    """Collectives over a subgroup of world ranks {0, size-1}; other ranks get None."""
    members = [0, size - 1]
    group = colls.new_group(members)
    x_all = all_data(size, "float32", (3,), salt=5)
    x = jnp.asarray(x_all[rank])
    results = {}
    for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        results[f"{mode} all_reduce"] = wrap(partial(cj.all_reduce, group=group))(x)
        results[f"{mode} broadcast"] = wrap(partial(cj.broadcast, src=size - 1, group=group))(x)
        results[f"{mode} all_gather"] = wrap(partial(cj.all_gather, group=group))(x)
    if rank not in members:
        if any(v is not None for v in results.values()):
            raise AssertionError(f"non-member rank {rank} got {results}")
        return {"checks": len(results), "member": False}
    expected = {"all_reduce": x_all[0] + x_all[size - 1], "broadcast": x_all[size - 1],
                "all_gather": np.stack([x_all[m] for m in members])}
    for key, value in results.items():
        assert_equal(value, expected[key.split()[1]], "float32", f"subgroup {key}")
    return {"checks": len(results), "member": True}


# -- ordering -------------------------------------------------------------------------------------

ORDER_ROUNDS = 12


def _independent(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array, e: jax.Array, *,
                 size: int) -> tuple[jax.Array, ...]:
    """Five collectives with no data dependence between them, in one function.

    Different sizes, dtypes, ops and roots: if XLA could schedule them in a different order on
    two ranks, the ranks would wait for each other in different collectives (a hang) or mix up
    their data (a mismatch below).
    """
    ra = cj.all_reduce(a)
    rb = cj.broadcast(b, size - 1)
    rc = cj.all_gather(c)
    cj.barrier()
    rd = cj.shift(d, 1)
    re = cj.reduce_scatter(e, cj.ReduceOp.MAX, tiled=True)
    return ra, rb, rc, rd, re


def _order_inputs(rank: int, size: int, round_: int) -> list[list[np.ndarray]]:
    specs = [("float32", (4096,)), ("int32", (7, 3)), ("bfloat16", (5,)), ("bool", (33,)),
             ("float32", (size * 64, 2))]
    return [all_data(size, dtype, shape, salt=100 * round_ + i)
            for i, (dtype, shape) in enumerate(specs)]


def no_reordering(rank: int, size: int) -> dict[str, Any]:
    """Run a jitted function of independent collectives many times; every result must match.

    Each round also issues an eager all_reduce right after dispatching the jitted call (whose
    callbacks run asynchronously), which checks that eager and jitted collectives keep one order.
    """
    step = jax.jit(partial(_independent, size=size))
    checks = 0
    for round_ in range(ORDER_ROUNDS):
        ins = _order_inputs(rank, size, round_)
        outs = step(*(jnp.asarray(arrays[rank]) for arrays in ins))
        extra_all = all_data(size, "int32", (9,), salt=7000 + round_)
        extra = cj.all_reduce(jnp.asarray(extra_all[rank]))  # eager, while step may still run
        a, b, c, d, e = ins
        rows = e[0].shape[0] // size
        expected = [sum(x.astype(np.float64) for x in a), b[size - 1], np.stack(c),
                    d[(rank - 1) % size],
                    np.max(np.stack(e), axis=0)[rank * rows:(rank + 1) * rows]]
        for i, (dtype, got, want) in enumerate(zip(
                ("float32", "int32", "bfloat16", "bool", "float32"), outs, expected, strict=True)):
            assert_equal(got, _cast(dtype, want), dtype, f"round {round_} output {i}")
        assert_equal(extra, sum(extra_all), "int32", f"round {round_} eager all_reduce")
        checks += 6
    return {"checks": checks}


# -- suites: several checks per spawned job (starting JAX costs seconds per process) -------------


def collectives_suite(rank: int, size: int) -> dict[str, Any]:
    """every_op, vmapped_ops and subgroup_ops in one job."""
    from colls_jax import _ffi

    return {"every_op": every_op(rank, size), "vmap": vmapped_ops(rank, size),
            "subgroup": subgroup_ops(rank, size), "jit_path": _ffi.path()}


def jit_and_grad_suite(rank: int, size: int) -> dict[str, Any]:
    """no_reordering, then the gradient checks of jax_grad_workers, in one job."""
    from colls_jax import _ffi
    from jax_grad_workers import data_parallel, vjps

    return {"order": no_reordering(rank, size), "vjps": vjps(rank, size),
            "data_parallel": data_parallel(rank, size), "jit_path": _ffi.path()}
