"""2-D heat equation on slabs of rows: the halo exchange and residual of an mpi4py code, in colls.

Solves u_t = u_xx + u_yy on the unit square with u = 0 on the boundary (explicit Euler, 5-point
stencil). The N x N interior is split into slabs of rows, one per rank; each step every rank
swaps one ghost row with each neighbour (``batch_isend_irecv``; ``colls.PROC_NULL`` at the top
and bottom of the domain) and the ranks add up the squared update (``colls.functional.all_reduce``
of a Python float). Rank 0 checks the distributed field against a serial run.

Run with any backend:

    colls-run --nproc-per-node 4 examples/heat2d.py --n 64 --steps 50        # tcp
    mpiexec -n 4 python examples/heat2d.py --backend mpi --n 64 --steps 50   # mpi

docs/mpi4py.md walks through it beside the same code in mpi4py.
"""

from __future__ import annotations

import argparse

import numpy as np

import colls


def initial(n: int) -> np.ndarray:
    """Return the initial N x N interior field (a smooth bump, zero at the boundary)."""
    x = np.linspace(0, 1, n + 2)[1:-1]
    return np.outer(np.sin(np.pi * x), np.sin(2 * np.pi * x)) + 0.25


def step(u: np.ndarray, r: float) -> np.ndarray:
    """Return the interior rows after one step; ``u`` holds a ghost row above and below."""
    inner = u[1:-1]
    left = np.zeros_like(inner)
    right = np.zeros_like(inner)
    left[:, 1:] = inner[:, :-1]
    right[:, :-1] = inner[:, 1:]
    return inner + r * (u[:-2] + u[2:] + left + right - 4 * inner)


def serial(n: int, steps: int, r: float) -> np.ndarray:
    """Return the field after ``steps`` steps on one process."""
    u = np.zeros((n + 2, n))
    u[1:-1] = initial(n)
    for _ in range(steps):
        u[1:-1] = step(u, r)
    return u[1:-1]


def exchange_halos(u: np.ndarray, up: int, down: int) -> None:
    """Send the first and last interior rows to the neighbours; receive the ghost rows.

    The mpi4py code this replaces: ``comm.Sendrecv(u[1], up, 0, u[-1], down, 0)`` and
    ``comm.Sendrecv(u[-2], down, 1, u[0], up, 1)``.
    """
    ops = [
        colls.P2POp(colls.irecv, u[0], up, tag=1),
        colls.P2POp(colls.irecv, u[-1], down, tag=0),
        colls.P2POp(colls.isend, u[1], up, tag=0),
        colls.P2POp(colls.isend, u[-2], down, tag=1),
    ]
    for work in colls.batch_isend_irecv(ops):
        work.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--n", type=int, default=48, help="interior points per side")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--backend", default="tcp", help="tcp (colls-run) or mpi (mpiexec)")
    args = parser.parse_args()

    colls.init_process_group(args.backend)
    rank, size = colls.get_rank(), colls.get_world_size()
    n, r = args.n, 0.2  # r = dt / h^2 < 1/4: stable
    rows = [n // size + (i < n % size) for i in range(size)]
    first = sum(rows[:rank])
    up = rank - 1 if rank > 0 else colls.PROC_NULL  # the domain's edge: nobody to talk to
    down = rank + 1 if rank < size - 1 else colls.PROC_NULL

    u = np.zeros((rows[rank] + 2, n))  # one ghost row above and below the slab
    u[1:-1] = initial(n)[first:first + rows[rank]]
    residual = 0.0
    for _ in range(args.steps):
        exchange_halos(u, up, down)
        new = step(u, r)
        residual = colls.functional.all_reduce(float(np.sum((new - u[1:-1]) ** 2))) ** 0.5
        u[1:-1] = new

    slabs = [None] * size
    colls.all_gather_object(slabs, u[1:-1])
    if rank == 0:
        error = np.max(np.abs(np.concatenate(slabs) - serial(n, args.steps, r)))
        print(f"heat2d on {size} ranks ({args.backend}), {n}x{n}, {args.steps} steps: "
              f"residual {residual:.6e}, max |distributed - serial| = {error:.3e}")
        assert error < 1e-12, error
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
