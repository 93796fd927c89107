"""Data-parallel training of a tiny JAX MLP with colls_jax, checked against one process.

Every rank holds the same parameters and a shard of the batch. One jitted step computes the
gradient of the rank's mean loss with jax.grad and averages it over the ranks with
``colls_jax.all_reduce(g, ReduceOp.AVG)``, inside the same jitted function (an ordered host
callback). With equal shards that average is the full-batch gradient, so after training rank 0
replays the run on the whole batch in a single process and checks that the parameters match.

Run with:  colls-run --nproc-per-node 4 examples/jax_data_parallel.py
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # 4 processes on one host: keep JAX on the CPU

import colls_jax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import colls  # noqa: E402

BATCH = 96  # divisible by 1, 2, 3, 4, 6, 8 ranks
FEATURES, HIDDEN = 5, 16
STEPS = 50
LEARNING_RATE = 0.05


def init_problem() -> tuple[dict[str, jax.Array], np.ndarray, np.ndarray]:
    """Return initial parameters and a synthetic regression batch (the same on every rank)."""
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(scale=0.5, size=(FEATURES, HIDDEN)), jnp.float32),
        "b1": jnp.zeros(HIDDEN, jnp.float32),
        "w2": jnp.asarray(rng.normal(scale=0.5, size=HIDDEN), jnp.float32),
    }
    inputs = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
    targets = np.sin(inputs @ rng.normal(size=FEATURES)).astype(np.float32)
    return params, inputs, targets


def loss_fn(params: dict[str, jax.Array], inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean squared error of a one-hidden-layer tanh MLP."""
    hidden = jnp.tanh(inputs @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - targets) ** 2)


@jax.jit
def data_parallel_step(params, inputs, targets):
    """One SGD step on this rank's shard, gradients averaged over all ranks."""
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
    grads = jax.tree.map(lambda g: colls_jax.all_reduce(g, colls_jax.ReduceOp.AVG), grads)
    loss = colls_jax.all_reduce(loss, colls_jax.ReduceOp.AVG)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


@jax.jit
def single_process_step(params, inputs, targets):
    """The reference: one SGD step on the whole batch, no communication."""
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss


def main() -> None:
    colls.init_process_group("tcp")  # env:// rendezvous, as set up by colls-run
    rank, size = colls.get_rank(), colls.get_world_size()
    if BATCH % size:
        raise SystemExit(f"BATCH={BATCH} must be divisible by the number of ranks ({size})")
    params, inputs, targets = init_problem()
    rows = BATCH // size
    shard = slice(rank * rows, (rank + 1) * rows)
    local_x, local_y = jnp.asarray(inputs[shard]), jnp.asarray(targets[shard])

    trained = params
    for step in range(STEPS):
        trained, loss = data_parallel_step(trained, local_x, local_y)
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}: loss {float(loss):.5f}")

    if rank == 0:
        reference = params
        full_x, full_y = jnp.asarray(inputs), jnp.asarray(targets)
        for _ in range(STEPS):
            reference, _ = single_process_step(reference, full_x, full_y)
        for name in params:
            np.testing.assert_allclose(np.asarray(trained[name]), np.asarray(reference[name]),
                                       rtol=1e-4, atol=1e-5, err_msg=name)
        print(f"{size} ranks: final parameters match the single-process full-batch run "
              f"(final loss {float(loss_fn(trained, full_x, full_y)):.5f})")
    colls_jax.barrier()
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
