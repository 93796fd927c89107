"""Rank functions of the colls_jax gradient tests (module level, for colls.testing.spawn).

Two kinds of checks: the VJP of every linear collective against its transpose computed in NumPy
from every rank's cotangent, and a data-parallel training step whose gradients and parameters
must equal a single-process run on the full batch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import colls_jax as cj
import jax
import jax.numpy as jnp
import numpy as np
from jax_reference import all_data, assert_equal

# -- VJPs of the linear collectives ---------------------------------------------------------------


def _linear_ops(size: int) -> dict[str, tuple[Callable[[jax.Array], jax.Array], bool]]:
    """name -> (op, whether it takes the (size, 3) input instead of (2*size, 3))."""
    avg, premul = cj.ReduceOp.AVG, cj.make_premul_sum(0.5)
    return {
        "all_reduce SUM": (cj.all_reduce, False),
        "all_reduce AVG": (partial(cj.all_reduce, op=avg), False),
        "all_reduce PREMUL_SUM": (partial(cj.all_reduce, op=premul), False),
        "broadcast": (partial(cj.broadcast, src=size - 1), False),
        "reduce SUM": (partial(cj.reduce, dst=0), False),
        "all_gather": (cj.all_gather, False),
        "all_gather tiled": (partial(cj.all_gather, tiled=True), False),
        "reduce_scatter": (cj.reduce_scatter, True),
        "reduce_scatter tiled": (partial(cj.reduce_scatter, tiled=True), False),
        "reduce_scatter AVG tiled": (partial(cj.reduce_scatter, op=avg, tiled=True), False),
        "all_to_all": (cj.all_to_all, False),
        "gather": (partial(cj.gather, dst=size - 1), False),
        "scatter": (partial(cj.scatter, src=0), True),
        "shift": (cj.shift, False),
        "ppermute": (partial(cj.ppermute, perm=[(0, size - 1)]), False),
    }


def _expected_grad(name: str, w: list[np.ndarray], rank: int, size: int) -> np.ndarray:
    """The transpose of op ``name`` applied to every rank's cotangent ``w``, for ``rank``."""
    total = sum(w)
    rows = 2
    block = slice(rank * rows, (rank + 1) * rows)
    zeros_like_out = np.zeros_like(w[0])
    table: dict[str, Callable[[], np.ndarray]] = {
        "all_reduce SUM": lambda: total,
        "all_reduce AVG": lambda: total / size,
        "all_reduce PREMUL_SUM": lambda: 0.5 * total,
        "broadcast": lambda: total if rank == size - 1 else zeros_like_out,
        "reduce SUM": lambda: w[0],
        "all_gather": lambda: total[rank],
        "all_gather tiled": lambda: total[rank * 2 * size:(rank + 1) * 2 * size],
        "reduce_scatter": lambda: np.stack(w),
        "reduce_scatter tiled": lambda: np.concatenate(w),
        "reduce_scatter AVG tiled": lambda: np.concatenate(w) / size,
        "all_to_all": lambda: np.concatenate([w[i][block] for i in range(size)]),
        "gather": lambda: w[size - 1][rank],
        "scatter": lambda: np.stack(w) if rank == 0 else np.zeros((size, *w[0].shape)),
        "shift": lambda: w[(rank + 1) % size],
        "ppermute": lambda: w[size - 1] if rank == 0 else zeros_like_out,
    }
    return table[name]()


def vjps(rank: int, size: int) -> dict[str, Any]:
    """jax.grad through every linear collective, eagerly and under jit, against NumPy.

    Under jit all gradients come from one jitted function (one compile; every VJP's
    collectives then also run in one ordered program).
    """
    x_all = all_data(size, "float32", (2 * size, 3), salt=11)
    xs_all = all_data(size, "float32", (size, 3), salt=12)
    ops = _linear_ops(size)
    inputs, weights, expected = {}, {}, {}
    for index, (name, (op, small)) in enumerate(ops.items()):
        inputs[name] = jnp.asarray((xs_all if small else x_all)[rank])
        w = all_data(size, "float32", jax.eval_shape(op, inputs[name]).shape, salt=200 + index)
        weights[name] = jnp.asarray(w[rank])
        expected[name] = np.asarray(_expected_grad(name, w, rank, size), np.float32)

    def all_grads(xs: dict[str, jax.Array], ws: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {name: jax.grad(lambda v, w, op=op: jnp.sum(w * op(v)))(xs[name], ws[name])
                for name, (op, _) in ops.items()}

    checks = 0
    for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        got = wrap(all_grads)(inputs, weights)
        for name in ops:
            assert_equal(got[name], expected[name], "float32", f"{mode} grad of {name}")
            checks += 1
    checks += _vmap_of_grad(rank, size)
    return {"checks": checks}


def _vmap_of_grad(rank: int, size: int) -> int:
    """Per-example gradients through all_reduce: vmap(grad(...)) under jit."""
    xb = jnp.asarray(all_data(size, "float32", (4, 3), salt=13)[rank])
    w_all = all_data(size, "float32", (3,), salt=14)
    grad = jax.grad(lambda v: jnp.sum(jnp.asarray(w_all[rank]) * cj.all_reduce(v)))
    got = jax.jit(jax.vmap(grad))(xb)
    assert_equal(got, np.broadcast_to(sum(w_all), (4, 3)), "float32", "jit(vmap(grad))")
    return 1


# -- data-parallel training -----------------------------------------------------------------------

BATCH = 12  # divisible by 2, 3 and 4 ranks
STEPS = 5
LEARNING_RATE = 0.1


def problem() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """A tiny MLP regression: parameters, inputs (BATCH, 3) and targets (BATCH,)."""
    rng = np.random.default_rng(7)
    params = {"w1": rng.normal(size=(3, 4)).astype(np.float32),
              "b1": rng.normal(size=4).astype(np.float32),
              "w2": rng.normal(size=4).astype(np.float32)}
    inputs = rng.normal(size=(BATCH, 3)).astype(np.float32)
    targets = rng.normal(size=BATCH).astype(np.float32)
    return params, inputs, targets


def sum_squared_error(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Sum over the rows of (model(x) - y)^2."""
    hidden = jnp.tanh(inputs @ params["w1"] + params["b1"])
    return jnp.sum((hidden @ params["w2"] - targets) ** 2)


def full_batch_loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """The single-process objective: mean squared error over the whole batch."""
    return sum_squared_error(params, inputs, targets) / BATCH


def distributed_loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """The same objective on a shard: parameters averaged in, errors summed over ranks.

    With the VJPs of colls_jax (all_reduce -> all_reduce of the cotangents), jax.grad of this
    is exactly the full-batch gradient on every rank, with no gradient all_reduce afterwards.
    """
    shared = jax.tree.map(lambda p: cj.all_reduce(p, cj.ReduceOp.AVG), params)
    return cj.all_reduce(sum_squared_error(shared, inputs, targets)) / BATCH


def global_loss(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """The full-batch loss on every rank (errors summed over ranks), parameters used as is."""
    return cj.all_reduce(sum_squared_error(params, inputs, targets)) / BATCH


def data_parallel(rank: int, size: int) -> dict[str, Any]:
    """Gradients and a few SGD steps of a data-parallel run equal the full-batch run."""
    params, inputs, targets = problem()
    rows = BATCH // size
    shard = slice(rank * rows, (rank + 1) * rows)
    local = (jnp.asarray(inputs[shard]), jnp.asarray(targets[shard]))
    want = jax.jit(jax.grad(full_batch_loss))(params, jnp.asarray(inputs), jnp.asarray(targets))
    checks = 0
    for mode, wrap in (("eager", lambda f: f), ("jit", jax.jit)):
        got = wrap(jax.grad(distributed_loss))(params, *local)
        checks += _close(got, want, f"{mode} grad of distributed_loss")
        # The usual recipe: grad of the global loss, then average the gradients.
        grads = wrap(jax.grad(global_loss))(params, *local)
        averaged = jax.tree.map(lambda g: cj.all_reduce(g, cj.ReduceOp.AVG), grads)
        checks += _close(averaged, want, f"{mode} averaged grad of the global loss")
    checks += _close(_train(params, local, distributed=True),
                     _train(params, (jnp.asarray(inputs), jnp.asarray(targets)), False),
                     "parameters after training")
    return {"checks": checks}


def _train(params: Any, batch: tuple[jax.Array, jax.Array], distributed: bool) -> Any:
    loss = distributed_loss if distributed else full_batch_loss

    @jax.jit
    def step(p: Any) -> Any:
        grads = jax.grad(loss)(p, *batch)
        return jax.tree.map(lambda v, g: v - LEARNING_RATE * g, p, grads)

    for _ in range(STEPS):
        params = step(params)
    return params


def _close(got: Any, want: Any, what: str) -> int:
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=2e-5,
                                   atol=2e-6, err_msg=f"{what}: {key}")
    return 1
